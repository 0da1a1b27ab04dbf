import logging
import time

import bad_rewards  # tests/actors/bad_rewards.py: the module Reward imports by name, whose RELEASE the tests set
import numpy as np
import pytest
import torch
from reward_configs import reward_config

from actors.reward import Reward
from actors.rewards.scoring import ScoreResult
from cluster.demo.sentiment import SENTIMENT_SCALE, sentiment

SENTIMENT = "cluster.demo.sentiment:sentiment"


@pytest.fixture(scope="module")
def rm(reward_path):
    return Reward(config=reward_config(model=reward_path, batch_size=3))


def _batch(seed=0, lens=((3, 4), (9, 2), (5, 7), (1, 0), (6, 3), (2, 8), (4, 4))):
    rng = np.random.default_rng(seed)
    return ([rng.integers(2, 1024, size=p) for p, _ in lens],
            [rng.integers(2, 1024, size=r) for _, r in lens])


def _encode(tokenizer, texts):
    return [np.array(tokenizer(t)["input_ids"]) for t in texts]


def _rollouts(prompts, responses):
    from core.rollout import Rollout

    return [Rollout(prompt_ids=p, response_ids=r, behaviour_logprobs=np.zeros(r.size, np.float32),
                    finish_reason="stop", policy_version=0, prompt_index=i, sample_index=0)
            for i, (p, r) in enumerate(zip(prompts, responses))]


# --------------------------------------------------------------------------- model path


@pytest.mark.integration
@pytest.mark.parametrize("packing", [True, False])
def test_model_batched_equals_unbatched_and_hf(rm, reward_path, packing):
    """Packed (one row per forward) or right-padded, a score is that of the sequence alone."""
    from transformers import AutoModelForSequenceClassification

    rm = rm if packing else Reward(config=reward_config(model=reward_path, batch_size=3, packing=False))
    assert rm.health()["packing"] is packing
    prompts, responses = _batch()
    res = rm.score(prompts, responses)
    assert isinstance(res, ScoreResult) and res.scores.dtype == np.float32
    assert res.valid.all() and res.errors == []
    hf = AutoModelForSequenceClassification.from_pretrained(reward_path).eval()
    for i, (p, r) in enumerate(zip(prompts, responses)):
        single = rm.score([p], [r]).scores[0]
        assert abs(single - res.scores[i]) < 1e-5
        with torch.no_grad():  # no padding and no pad id inside: HF's own pooling agrees
            direct = hf(torch.tensor(np.concatenate([p, r]))[None]).logits[0, 0].item()
        assert abs(single - direct) < 1e-5
    assert len(set(np.round(res.scores, 5))) == len(prompts)  # scores depend on the input


@pytest.mark.integration
def test_bf16_model_computes_in_bf16_and_scores_close_to_fp32(rm, reward_path):
    bf16 = Reward(config=reward_config(model=reward_path, batch_size=3), dtype="bfloat16")
    assert bf16.health()["dtype"] == "bfloat16" and rm.health()["dtype"] == "float32"
    prompts, responses = _batch()
    low, full = bf16.score(prompts, responses).scores, rm.score(prompts, responses).scores
    assert low.dtype == np.float32 and not np.array_equal(low, full)  # bf16 really ran
    assert np.abs(low - full).max() < 0.05 * (np.abs(full).max() + 1)


@pytest.mark.integration
def test_model_scores_last_token_even_when_it_is_the_pad_id(rm, tokenizer):
    # HF pools at the last token whose id != pad id, which is wrong when pad == eos ends
    # the response. We read the last real token whatever its id.
    pad = tokenizer.pad_token_id
    prompts, responses = _batch(seed=1, lens=((3, 3), (5, 6)))
    responses = [np.append(r, pad) for r in responses]
    batched = rm.score(prompts, responses).scores
    without_last = rm.score(prompts, [r[:-1] for r in responses]).scores
    assert not np.allclose(batched, without_last, atol=1e-4)
    seq = torch.tensor(np.concatenate([prompts[0], responses[0]]))[None]
    with torch.no_grad():
        h = rm.reward_model.model.base_model(input_ids=seq).last_hidden_state[0, -1]
        manual = rm.reward_model.model.score(h).item()
    assert abs(batched[0] - manual) < 1e-5


@pytest.mark.integration
def test_model_path_errors(policy_path, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        Reward(config=reward_config(model=str(tmp_path / "nowhere")))
    (tmp_path / "not-a-model").mkdir()
    with pytest.raises(ValueError, match="not-a-model.*no config.json"):
        Reward(config=reward_config(model=str(tmp_path / "not-a-model")))
    with pytest.raises(ValueError, match="num_labels=2"):  # a causal LM dir has no 1-label head
        Reward(config=reward_config(model=policy_path))


# --------------------------------------------------------------------------- function path


@pytest.mark.unit
def test_sentiment_function():
    assert sentiment(["p"], ["good good"]) == [SENTIMENT_SCALE]
    assert sentiment(["p"], ["The cat was sad."]) == [-SENTIMENT_SCALE / 4]
    assert sentiment(["p"], ["Great, but dark and COLD!"]) == [-SENTIMENT_SCALE / 5]
    assert sentiment(["good good good"], [""]) == [0.0]  # prompt ignored, empty reply is 0
    with pytest.raises(ValueError):
        sentiment(["a", "b"], ["x"])


@pytest.mark.integration
def test_function_path_decodes_and_scores(policy_path, tokenizer):
    rw = Reward(config=reward_config(function=SENTIMENT), tokenizer=policy_path)
    texts = ["the cat was good", "the cat was sad", "the cat was"]
    responses = _encode(tokenizer, texts)
    responses[0] = np.append(responses[0], tokenizer.eos_token_id)  # special tokens are skipped
    prompts = _encode(tokenizer, ["Once"] * 3)
    res = rw.score(prompts, responses)
    np.testing.assert_allclose(res.scores, sentiment(["Once"] * 3, texts), atol=1e-6)
    assert res.scores[0] > 0 > res.scores[1] and res.scores[2] == 0
    assert res.valid.all() and rw.stats()["items"] == 3


@pytest.mark.integration
def test_a_run_with_a_teacher_and_no_reward_scores_every_pair_zero(policy_path, tokenizer):
    """Pure distillation: no reward key set, the teacher's term is the whole advantage."""
    from actors.rewards.source import reward_source
    from cluster.config.ppo import load_config

    cfg = load_config(None, ["reward.function=null", "teacher.model=builtin:tiny"])
    cfg.validate()
    source = reward_source(cfg)
    assert source.summary == "teacher builtin:tiny" and not source.holds_model and not source.from_episodes
    rw = Reward(config=cfg.reward.scoring(), source=source, tokenizer=policy_path)
    res = rw.score(_encode(tokenizer, ["Once"] * 2), _encode(tokenizer, ["the cat was good", "sad"]))
    assert res.scores.tolist() == [0.0, 0.0] and res.valid.all()


@pytest.mark.integration
def test_nan_scores_mark_items_invalid(policy_path, tokenizer, caplog):
    rw = Reward(config=reward_config(function="bad_rewards:nan_for_odd"), tokenizer=policy_path)
    prompts, responses = _batch(seed=2, lens=((2, 2),) * 4)
    with caplog.at_level(logging.WARNING, logger="actors.reward"):
        res = rw.score(prompts, responses)
    assert res.valid.tolist() == [True, False, True, False]
    assert res.scores[0] == 1.0 and np.isnan(res.scores[1])
    assert len(res.errors) == 1 and "bad_rewards:nan_for_odd" in res.errors[0]
    assert "2 of 4" in res.errors[0] and "bad_rewards:nan_for_odd" in caplog.text
    stats = rw.stats()
    assert stats["invalid_items"] == 2 and stats["items"] == 4
    assert "nan_for_odd" in stats["last_error"]


@pytest.mark.integration
@pytest.mark.parametrize("name, needle", [
    ("raising", "RuntimeError: reward service unavailable"),
    ("wrong_length", "returned 1 scores for 3 items"),
])
def test_broken_function_invalidates_batch_without_crashing(policy_path, name, needle):
    rw = Reward(config=reward_config(function=f"bad_rewards:{name}"), tokenizer=policy_path)
    prompts, responses = _batch(seed=3, lens=((2, 2),) * 3)
    for _ in range(2):  # the actor keeps serving after a failure
        res = rw.score(prompts, responses)
        assert not res.valid.any() and np.isnan(res.scores).all()
        assert len(res.errors) == 1 and "\n" not in res.errors[0]
        assert f"bad_rewards:{name}" in res.errors[0] and needle in res.errors[0]
    h = rw.health()
    assert h["ok"] and h["failed_calls"] == 2 and h["invalid_items"] == 6


@pytest.mark.integration
def test_items_that_are_not_numbers_are_invalid_one_by_one(policy_path):
    rw = Reward(config=reward_config(function="bad_rewards:some_not_numbers"), tokenizer=policy_path)
    prompts, responses = _batch(seed=3, lens=((2, 2),) * 5)
    res = rw.score(prompts, responses)
    assert res.valid.tolist() == [True, False, True, False, False]
    assert res.scores[0] == 1.0 and res.scores[2] == 2.0
    assert len(res.errors) == 1 and "NoneType, str instead of a number for 3 of 5 items" in res.errors[0]
    h = rw.health()
    assert h["failed_calls"] == 0 and h["invalid_items"] == 3


def _wait_until(predicate, deadline_s=60.0):
    end = time.monotonic() + deadline_s
    while not predicate():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


@pytest.mark.integration
def test_a_call_past_the_timeout_invalidates_its_items_and_the_replica_serves_on(policy_path, tokenizer):
    from actors.rewards.scoring import MAX_ABANDONED_CALLS

    bad_rewards.RELEASE.clear()
    rw = Reward(config=reward_config(function="bad_rewards:hangs_when_asked", timeout_s=2), tokenizer=policy_path)
    prompts = _encode(tokenizer, ["Once"] * 2)
    fine, hangs = _encode(tokenizer, ["a cat", "a dog"]), _encode(tokenizer, ["a cat", "hang on"])
    try:
        assert rw.score(prompts, fine).valid.all()
        for i in range(MAX_ABANDONED_CALLS):
            res = rw.score(prompts, hangs)
            assert not res.valid.any() and np.isnan(res.scores).all() and res.counts["timeouts"] == 2
            assert res.errors == ["reward function bad_rewards:hangs_when_asked did not return within "
                                  f"reward.timeout_s=2 s; all 2 items invalid (the call goes on in the background: "
                                  f"{i + 1} such, at most {MAX_ABANDONED_CALLS})"]
            if i + 1 < MAX_ABANDONED_CALLS:
                assert rw.score(prompts, fine).valid.all()  # the next call is served
        refused = rw.score(prompts, fine)  # the abandoned calls are bounded: no more threads
        assert not refused.valid.any() and "not called: 4 earlier calls are still running" in refused.errors[0]
        assert rw.stats()["abandoned_calls"] == MAX_ABANDONED_CALLS
    finally:
        bad_rewards.RELEASE.set()
    _wait_until(lambda: rw.stats()["abandoned_calls"] == 0)  # they returned; what they return is dropped
    res = rw.score(prompts, fine)
    assert res.valid.all() and rw.stats()["failed_calls"] == MAX_ABANDONED_CALLS + 1


@pytest.mark.integration
def test_a_gold_call_past_the_timeout_invalidates_its_items(policy_path, tokenizer):
    bad_rewards.RELEASE.clear()
    rw = Reward(config=reward_config(function=SENTIMENT, gold="bad_rewards:hangs_when_asked", timeout_s=1),
                tokenizer=policy_path)
    rollouts = _rollouts(_encode(tokenizer, ["Then"] * 2), _encode(tokenizer, ["a cat", "hang on"]))
    try:
        gold = rw.gold_scores(rollouts)
        assert not gold.valid.any()
        assert gold.errors[0].startswith("reward.gold bad_rewards:hangs_when_asked did not return within "
                                         "reward.timeout_s=1 s; all 2 items invalid")
        assert rw.score_rollouts(rollouts).valid.all()  # the reward itself is unaffected
    finally:
        bad_rewards.RELEASE.set()


@pytest.mark.unit
def test_the_probe_refuses_a_function_that_does_not_return_in_time():
    from actors.rewards.probe import probe_function

    bad_rewards.RELEASE.clear()
    try:
        with pytest.raises(ValueError) as e:
            probe_function("bad_rewards:hangs_when_asked", ["p", "q"], ["hang", "x"], "reward.gold", timeout_s=0.5)
    finally:
        bad_rewards.RELEASE.set()
    assert str(e.value) == ("reward.gold 'bad_rewards:hangs_when_asked' did not return within reward.timeout_s=0.5 s "
                            "on a probe with 2 example (prompt, response) pairs; make it return sooner, or raise "
                            "reward.timeout_s")


@pytest.mark.unit
def test_construction_errors():
    policy_path = "/never-read"  # every check below fires before the tokenizer is loaded
    for bad in ("no_such_module_xyz:f", "bad_rewards:missing", "bad_rewards", "cluster.demo.sentiment:"):
        with pytest.raises(ValueError) as e:
            Reward(config=reward_config(function=bad), tokenizer=policy_path)
        assert "\n" not in str(e.value) and bad.split(":")[0] in str(e.value)
    with pytest.raises(ValueError, match="exactly one"):
        Reward(config=reward_config())
    with pytest.raises(ValueError, match="exactly one"):
        Reward(config=reward_config(model=policy_path, function=SENTIMENT))
    with pytest.raises(ValueError, match="tokenizer"):
        Reward(config=reward_config(function=SENTIMENT))
    with pytest.raises(FileNotFoundError, match="no-tok-here"):
        Reward(config=reward_config(function=SENTIMENT), tokenizer="/no-tok-here")


@pytest.mark.integration
# The slow tier. The default tier runs reward replicas as Ray actors: a function's in
# tests/e2e/test_train.py::test_sync_default_learns, a reward model's in
# tests/e2e/test_reward_model.py::test_ppo_on_a_normalised_reward_model.
@pytest.mark.slow
def test_runs_unchanged_as_ray_actor(reward_path, policy_path, tokenizer, ray_cluster):
    ray = ray_cluster
    prompts, responses = _batch(seed=5)
    model_actor = ray.remote(Reward).remote(config=reward_config(model=reward_path))
    remote = ray.get(model_actor.score.remote(prompts, responses))
    local = Reward(config=reward_config(model=reward_path)).score(prompts, responses)
    np.testing.assert_allclose(remote.scores, local.scores, atol=1e-6)
    # The worker imports the function itself (a user's module must be importable there too,
    # e.g. shipped with the job's runtime_env; the built-in one always is).
    fn_actor = ray.remote(Reward).remote(config=reward_config(function=SENTIMENT), tokenizer=policy_path)
    texts = ["a dog was happy", "a dog was cruel"]
    res = ray.get(fn_actor.score.remote(_encode(tokenizer, ["Then"] * 2), _encode(tokenizer, texts)))
    np.testing.assert_allclose(res.scores, sentiment(["Then"] * 2, texts), atol=1e-6)
    assert ray.get(fn_actor.health.remote())["items"] == 2


# --------------------------------------------------------------------------- gold (evaluation only)


@pytest.mark.integration
def test_gold_scores_the_decoded_text_beside_a_reward_model(reward_path, policy_path, tokenizer):
    texts = ["The cat was happy and glad.", "It was a sad, grim day.", "Fine."]
    prompts, responses = _encode(tokenizer, ["My friend felt"] * 3), _encode(tokenizer, texts)
    rollouts = _rollouts(prompts, responses)
    reward = Reward(config=reward_config(model=reward_path, gold=SENTIMENT), tokenizer=policy_path)
    gold = reward.gold_scores(rollouts)
    decoded = tokenizer.batch_decode([r.tolist() for r in responses], skip_special_tokens=True)
    assert gold.valid.all() and np.allclose(gold.scores, sentiment([""] * 3, decoded))
    assert gold.scores[0] > 0 > gold.scores[1]  # the function's scores, not the model's
    assert reward.stats()["items"] == 0  # evaluation does not count as scoring
    assert not np.allclose(reward.score_rollouts(rollouts).scores, gold.scores)
    with pytest.raises(ValueError, match="no gold function; set reward.gold"):
        Reward(config=reward_config(model=reward_path)).gold_scores(rollouts)
    with pytest.raises(ValueError, match=r"^reward.gold 'nope' must look like 'module:function'"):
        Reward(config=reward_config(model=reward_path, gold="nope"), tokenizer=policy_path)
    broken = Reward(config=reward_config(model=reward_path, gold="bad_rewards:raising"), tokenizer=policy_path)
    result = broken.gold_scores(rollouts)  # a failing gold function invalidates the batch, no crash
    assert not result.valid.any() and "reward.gold bad_rewards:raising raised" in result.errors[0]

"""Unit tests: learner config validation, batch layout, PolicyWithValueHead (no DeepSpeed)."""
import numpy as np
import pytest
import torch
from helpers import make_rollouts, model_logprobs

from learner.batch import collate, collate_lm, response_slice
from learner.config import LearnerConfig, OptimConfig, PPOConfig
from learner.policy import VALUE_HEAD_FILE, PolicyWithValueHead

pytestmark = pytest.mark.unit


# ------------------------------------------------------------------------ config


@pytest.mark.parametrize("cfg, world, match", [
    (LearnerConfig(zero_stage=5), 1, r"learner\.zero_stage=5 is out of range; use 0, 1, 2 or 3"),
    (LearnerConfig(ppo=PPOConfig(minibatch_size=6, micro_batch_size=4)), 1,
     r"learner\.ppo\.minibatch_size=6 is not divisible by world_size\*micro_batch_size=1\*4=4"),
    (LearnerConfig(ppo=PPOConfig(minibatch_size=4, micro_batch_size=1)), 8, r"world_size\*micro_batch_size=8\*1"),
    (LearnerConfig(dtype="float16"), 1, r"learner\.dtype='float16' is unknown"),
    (LearnerConfig(critic="separate"), 1, r"learner\.critic_model is required"),
    (LearnerConfig(optim=OptimConfig(lr=0)), 1, r"learner\.optim\.lr=0 must be"),
    (LearnerConfig(optim=OptimConfig(warmup_steps=10, total_steps=5)), 1, r"total_steps=5 is below warmup_steps"),
    (LearnerConfig(ppo=PPOConfig(clip_low=1.5)), 1, r"learner\.ppo\.clip_low=1\.5 must be in \(0, 1\)"),
    (LearnerConfig(ppo=PPOConfig(agg="mean")), 1, r"learner\.ppo\.agg='mean' is unknown"),
])
def test_config_errors_are_one_line_and_name_the_field(cfg, world, match):
    with pytest.raises(ValueError, match=match) as info:
        cfg.validate(world)
    assert "\n" not in str(info.value)


def test_config_from_dict_round_trip_and_unknown_keys():
    cfg = LearnerConfig.from_dict({"zero_stage": 3, "optim": {"lr": 1e-4, "betas": [0.9, 0.99]},
                                   "ppo": {"ppo_epochs": 2}})
    assert (cfg.zero_stage, cfg.optim.lr, cfg.optim.betas, cfg.ppo.ppo_epochs) == (3, 1e-4, (0.9, 0.99), 2)
    assert LearnerConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=r"learner\.ppo: unknown key\(s\) \['epochs'\]"):
        LearnerConfig.from_dict({"ppo": {"epochs": 2}})


def test_lr_schedule_warmup_then_linear_and_cosine_decay():
    lin = OptimConfig(warmup_steps=2, total_steps=6)
    assert [round(lin.lr_factor(s), 4) for s in range(8)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    cos = OptimConfig(warmup_steps=0, total_steps=4, decay="cosine", min_lr_ratio=0.1)
    assert cos.lr_factor(0) == pytest.approx(1.0) and cos.lr_factor(2) == pytest.approx(0.55)
    assert cos.lr_factor(99) == pytest.approx(0.1)
    assert OptimConfig(warmup_steps=3).lr_factor(50) == 1.0  # total_steps=0: constant after warm-up


def test_deepspeed_config_mirrors_ppo_sizes():
    ds = LearnerConfig(zero_stage=3, ppo=PPOConfig(minibatch_size=8, micro_batch_size=2)).deepspeed_config(2)
    sizes = (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"])
    assert sizes == (8, 2, 2)
    assert ds["zero_optimization"]["stage"] == 3


def test_the_gradient_bucket_is_no_bigger_than_what_trains():
    """ZeRO-3 allocates its gradient bucket per dtype up front: DeepSpeed's default would reserve
    2 GB per rank for a model of a million parameters (and a process running several engines
    ran out of address space to fork)."""
    config = LearnerConfig(zero_stage=3)
    assert config.deepspeed_config(1, trainable=919_809)["zero_optimization"]["reduce_bucket_size"] == 919_809
    assert config.deepspeed_config(1, trainable=7 * 10**9)["zero_optimization"]["reduce_bucket_size"] == 5 * 10**8
    assert config.deepspeed_config(1)["zero_optimization"]["reduce_bucket_size"] == 5 * 10**8


# ------------------------------------------------------------------------ batch layout


@pytest.fixture(scope="module")
def rollouts(policy_path):
    return make_rollouts(policy_path, 5, seed=3, empty=(4,))


def test_collate_left_pads_prompts_right_pads_responses(rollouts, pad_id):
    b = collate(rollouts, pad_id)
    P = max(r.prompt_ids.size for r in rollouts)
    R = max(r.response_ids.size for r in rollouts)
    assert b.input_ids.shape == b.attention_mask.shape == b.position_ids.shape == (5, P + R)
    assert b.response_mask.shape == b.rewards.shape == b.behaviour_logprobs.shape == (5, R)
    assert b.prompt_len == P and b.scores.shape == (5,)
    for row, r in enumerate(rollouts):
        p, n = r.prompt_ids.size, r.response_ids.size
        np.testing.assert_array_equal(b.input_ids[row, P - p:P], r.prompt_ids)
        np.testing.assert_array_equal(b.input_ids[row, P:P + n], r.response_ids)
        assert b.attention_mask[row].sum() == p + n and b.attention_mask[row, :P - p].sum() == 0
        assert b.position_ids[row, P - p] == 0 and b.position_ids[row, P + n - 1] == p + n - 1
        assert b.response_mask[row].sum() == n
        np.testing.assert_array_equal(b.rewards[row, :n], r.rewards)
    assert b.num_tokens() == sum(r.response_ids.size for r in rollouts)


def test_response_slice_and_minibatch_indexing(rollouts, pad_id):
    b = collate(rollouts, pad_id)
    cols = torch.arange(b.input_ids.shape[1])[None, :, None]
    sliced = response_slice(cols, b.prompt_len, b.response_len)
    assert sliced[0, 0, 0] == b.prompt_len - 1 and sliced.shape[1] == b.response_len
    parts = b.split(2)
    assert [len(p) for p in parts] == [2, 2, 1]
    torch.testing.assert_close(parts[1].rewards, b.rewards[2:4])
    picked = b[[4, 0]]
    torch.testing.assert_close(picked.input_ids, b.input_ids[[4, 0]])


def test_collate_errors(rollouts, pad_id):
    with pytest.raises(ValueError, match="zero valid response tokens"):
        collate([rollouts[4]], pad_id)
    with pytest.raises(ValueError, match="empty rollout list"):
        collate([], pad_id)
    with pytest.raises(ValueError, match="PTX batch"):
        collate_lm([[1]], pad_id)


# ------------------------------------------------------------------------ policy


@pytest.fixture(scope="module")
def policy(policy_path):
    return PolicyWithValueHead.from_pretrained(policy_path)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_response_logprobs_match_unpadded_hf(policy, policy_path, rollouts, pad_id, temperature):
    b = collate(rollouts, pad_id)
    with torch.no_grad():
        lp, values, ent = policy.response_logprobs_values(b, temperature)
    expected = model_logprobs(policy.lm, [r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts],
                              temperature)
    gap = max(float(np.abs(lp[i, :e.size].numpy() - e).max()) for i, e in enumerate(expected) if e.size)
    print(f"padded-batch vs unpadded HF logprob max abs diff (T={temperature}): {gap:.2e}")
    assert gap < 1e-5
    assert values.shape == ent.shape == lp.shape and torch.all(values == 0)  # zero-init head
    assert torch.all(ent[b.response_mask.bool()] > 0)


def test_trimmed_microbatch_gives_same_outputs(policy, rollouts, pad_id):
    b = collate(rollouts, pad_id)[[1, 3]]
    t = b.trimmed()
    assert t.input_ids.shape[1] <= b.input_ids.shape[1]
    with torch.no_grad():
        full, _, _ = policy.response_logprobs_values(b)
        trim, _, _ = policy.response_logprobs_values(t)
    m = t.response_mask.bool()
    torch.testing.assert_close(trim[m], full[:, :t.response_len][m], atol=1e-5, rtol=0)


def test_save_pretrained_loads_as_plain_hf_and_keeps_value_head(policy, rollouts, pad_id, tmp_path):
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        policy.value_head.weight.normal_()
    policy.save_pretrained(tmp_path)
    assert (tmp_path / VALUE_HEAD_FILE).is_file() and (tmp_path / "tokenizer.json").is_file()
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, policy.lm(ids).logits)
        again = PolicyWithValueHead.from_pretrained(tmp_path)
        b = collate(rollouts, pad_id)
        torch.testing.assert_close(again.response_logprobs_values(b)[1], policy.response_logprobs_values(b)[1])
    with torch.no_grad():
        policy.value_head.weight.zero_()


def test_separate_critic_from_reward_model(policy_path, reward_path, rollouts, pad_id, tmp_path):
    from transformers import AutoModelForSequenceClassification

    model = PolicyWithValueHead.from_pretrained(policy_path, critic="separate", critic_model=reward_path)
    rm = AutoModelForSequenceClassification.from_pretrained(reward_path, dtype=torch.float32)
    torch.testing.assert_close(model.value_head.weight, rm.score.weight)  # critic starts as the RM head
    b = collate(rollouts, pad_id)
    with torch.no_grad():
        lp, values, _ = model.response_logprobs_values(b)
    assert values.abs().sum() > 0 and lp.shape == values.shape
    model.save_pretrained(tmp_path)
    again = PolicyWithValueHead.from_pretrained(tmp_path, critic="separate")  # no critic_model: uses critic/
    with torch.no_grad():
        torch.testing.assert_close(again.response_logprobs_values(b)[1], values)

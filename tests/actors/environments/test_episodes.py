"""Multi-turn episodes on the real vLLM CPU engine (actors/environments/episodes.py): the policy's tokens in a
transcript are exactly what vLLM sampled, each observation is exactly its tokenization, the
environment decides the turns, the reward and the end, and the learner scores the policy's
tokens as vLLM did (fp32, 1e-3)."""

import numpy as np
import pytest
import torch

from actors.environments.episodes import EpisodeRunner
from actors.environments.runners import SCHEDULES
from actors.environments.transcript import ObservationTokens
from actors.environments.workers import EnvironmentWorkers
from actors.generator import Generator

pytestmark = pytest.mark.integration

PROMPTS = ["The cat was", "A dog seemed happy", "My friend felt"]


@pytest.fixture(scope="module")
def policy():
    """The tiny policy pre-trained to end its sentences with EOS, both as plain text and after the
    generation prompt of each chat template below, so turns end where they should. (The plain
    corpus alone leaves what follows a template's markers to chance, which differs by CPU.)"""
    from transformers import AutoTokenizer

    from cluster.demo.pretrain import build_pretrained_policy
    from cluster.demo.sentiment import corpus

    tok = AutoTokenizer.from_pretrained(str(build_pretrained_policy()))
    tails = []
    for template in TEMPLATES.values():
        tok.chat_template = template
        prompt = tok.apply_chat_template([{"role": "user", "content": "ok 1"}], tokenize=False,
                                         add_generation_prompt=True)
        tails.append(prompt[-12:])  # the markers just before a turn; short, so a row fits the corpus length
    texts = corpus(2000) + [tail + line for tail in tails for line in corpus(400, seed=1)]
    return str(build_pretrained_policy(texts=texts))


@pytest.fixture(scope="module")
def generator(policy, in_process_engines):
    return Generator(model=policy, sampling={"temperature": 1.0, "max_new_tokens": 8, "n": 1},
                     engine={"max_model_len": 256, "kv_cache_bytes": 16 << 20})


def recorded(generator, schedule: str, sampled: dict):
    """The generator's sampler for ``schedule``, noting each turn's ids by its key."""
    if schedule == "rounds":
        def sample(transcripts, room, keys):
            turns = generator.sample_turns(transcripts, room, keys)
            sampled.update({key: t.token_ids for key, t in zip(keys, turns)})
            return turns
        return sample

    def admit(transcript, room, key, then):
        def noted(turn):
            sampled[key] = getattr(turn, "token_ids", None)
            then(turn)
        generator.admit_turn(transcript, room, key, noted)
    return admit


@pytest.mark.parametrize("schedule", ["rounds", "continuous"])
def test_a_transcript_keeps_the_sampled_tokens_and_the_observations_exactly(generator, policy, tokenizer, schedule):
    """Played in rounds or each episode at its own pace (its turns admitted into the running engine)."""
    from learner.batch import collate
    from learner.policy import PolicyWithValueHead

    observations = ObservationTokens(tokenizer)
    sampled = {}  # (prompt index, sample index, turn) -> the ids vLLM returned
    sample = recorded(generator, schedule, sampled)
    workers = EnvironmentWorkers("counter_envs:Counter", workers=2, step_timeout_s=30.0)
    try:
        runner = SCHEDULES[schedule](workers=workers, observations=observations, decode=tokenizer.decode,
                                     max_turns=4, max_tokens=120, max_turn_tokens=20)
        prompts = [(tokenizer(p)["input_ids"], i, p, {"start": i}) for i, p in enumerate(PROMPTS)]
        episodes = runner.run(prompts, 2, sample)
    finally:
        workers.close()
    assert len(episodes) == 6 and not any(ep.error for ep in episodes)
    for ep in episodes:
        start = ep.prompt_index
        assert ep.prompt_ids == tokenizer(PROMPTS[start])["input_ids"] + observations.ids(f"count from {start}")
        turns = [sampled[(ep.prompt_index, ep.sample_index, t)] for t in range(ep.turns)]
        mask = np.asarray(ep.mask)
        assert np.array_equal(np.asarray(ep.response)[mask], np.concatenate(turns))  # the policy's, as sampled
        want_obs = [i for k in range(1, ep.turns) for i in observations.ids(f"ok {start + k}")]
        assert np.array_equal(np.asarray(ep.response)[~mask], np.asarray(want_obs, dtype=np.int64))
        # Counter ends at its next multiple of 3 with reward 1: 3 turns from 0, 2 from 1, 1 from 2;
        # unless a turn ran to max_turn_tokens before its end of turn, which ends the episode there
        if turns[-1][-1] == observations.end_of_turn_id:
            assert ep.turns == 3 - start and ep.finish_reason == "stop" and ep.score == 1.0 and mask[-1]
        else:
            assert len(turns[-1]) == 20 and ep.finish_reason == "length" and ep.score == 0.0
    assert sum(ep.score for ep in episodes) >= 4  # most played to the end
    rollouts = [ep.rollout(version=0) for ep in episodes]
    model = PolicyWithValueHead.from_pretrained(policy, critic="none").eval()
    batch = collate(rollouts, pad_id=tokenizer.pad_token_id)
    with torch.no_grad():
        learner, _, _ = model.response_logprobs_values(batch, with_entropy=False)
    trained = batch.response_mask != 0
    gap = float((learner - batch.behaviour_logprobs)[trained].abs().max())
    print(f"{schedule}: {int(trained.sum())} policy tokens over {len(rollouts)} transcripts: "
          f"max |learner - vLLM| = {gap:.1e}")
    assert gap < 1e-3 and int(trained.sum()) == sum(r.trained_tokens for r in rollouts)


def test_a_skyrl_gym_environment_plays_unchanged_through_the_adapter(generator, tokenizer):
    """SkyRL-gym's multi-turn GSM8K environment, made by the adapter (actors/environments/skyrl.py),
    in tether's environment workers: its reward per turn, its follow-up message as the observation,
    its max_turns and done end the episode; the policy's tokens are the ones vLLM sampled."""
    from skyrl_gym.envs.gsm8k.utils import compute_score

    observations = ObservationTokens(tokenizer)
    workers = EnvironmentWorkers("skyrl_envs:GSM8kMultiTurn", workers=1, step_timeout_s=30.0)
    try:
        runner = EpisodeRunner(workers=workers, observations=observations, decode=tokenizer.decode,
                               max_turns=4, max_tokens=120, max_turn_tokens=24)
        rows = [("Tom has 2 apples and buys 3 more. How many now?", "5"), ("What is 7 minus 4?", "3")]
        prompts = [(tokenizer(p)["input_ids"], i, p, {"answer": a}) for i, (p, a) in enumerate(rows)]
        episodes = runner.run(prompts, 2, generator.sample_turns)
    finally:
        workers.close()
    print("skyrl episodes (turns, finish, score):", [(ep.turns, ep.finish_reason, ep.score) for ep in episodes])
    assert any(ep.turns == 2 for ep in episodes)  # the follow-up was seen (the tiny policy ends most turns)
    follow_up = observations.ids("Now provide only the final numeric answer in the exact format: '#### ANSWER'.")
    assert len(episodes) == 4 and not any(ep.error for ep in episodes)
    for ep in episodes:
        mask, response = np.asarray(ep.mask), np.asarray(ep.response)
        turns = np.split(response, np.flatnonzero(np.diff(mask.astype(int))) + 1)
        answer = rows[ep.prompt_index][1]
        first = compute_score(tokenizer.decode(turns[0]), answer, method="strict", format_score=0.1, score=1.0)
        if ep.finish_reason == "length" or first == 1.0:  # cut before its end of turn, or right at once
            assert ep.turns == 1
            continue
        assert ep.turns == 2 and response[~mask].tolist() == follow_up  # SkyRL's message, as its exact ids
        second = compute_score(tokenizer.decode(turns[2]), answer, method="strict", format_score=0.1, score=1.0)
        assert ep.score == pytest.approx(first + second)  # the environment's rewards per turn, summed


# Chat templates shaped like those of several model families, each ending an assistant turn with
# the tokenizer's eos token (what the engine stops on). The tiny tokenizer has none of their
# special tokens, so their markers split into several ids each: where an observation's ids meet
# the sampled ones is where re-tokenisation would drift.
TEMPLATES = {
    "chatml": ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "llama-3": ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}"
                "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant"
                "<|end_header_id|>\n\n{% endif %}"),
    "gemma": ("{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
              "{{ m['content'] }}{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
              "{% endif %}"),
    "phi-3": ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
    "mistral": ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
                "{% else %}[INST] {{ m['content'] }} [/INST]{% endif %}{% endfor %}"),  # no generation prompt
}


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_a_chat_transcript_is_the_templates_text_with_the_sampled_ids(generator, policy, family):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(policy)
    tok.chat_template = TEMPLATES[family]
    observations = ObservationTokens(tok)
    sampled = {}

    def sample(transcripts, room, keys):
        turns = generator.sample_turns(transcripts, room, keys)
        sampled.update({key: t.token_ids for key, t in zip(keys, turns)})
        return turns

    render = lambda chat, gen: tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
    prompts = [(tok(render([{"role": "user", "content": p}], True), add_special_tokens=False)["input_ids"], i, p,
                {"start": i}) for i, p in enumerate(PROMPTS)]
    workers = EnvironmentWorkers("counter_envs:Counter", workers=1, step_timeout_s=30.0)
    try:
        episodes = EpisodeRunner(workers=workers, observations=observations, decode=tok.decode, max_turns=4,
                                 max_tokens=160, max_turn_tokens=24).run(prompts, 1, sample)
    finally:
        workers.close()
    played = [ep for ep in episodes if ep.finish_reason == "stop"]
    print(f"{family}: {len(played)} of {len(episodes)} episodes played to the end")
    assert len(played) >= 2 and not any(ep.error for ep in episodes)
    for ep in episodes:
        turns = [sampled[(ep.prompt_index, 0, t)] for t in range(ep.turns)]
        mask = np.asarray(ep.mask)
        assert np.array_equal(np.asarray(ep.response)[mask], np.concatenate(turns))  # byte for byte the sampled ids
        # The whole transcript reads as the template's own rendering of the chat it is.
        start = ep.prompt_index
        chat = [{"role": "user", "content": PROMPTS[start]}, {"role": "user", "content": f"count from {start}"}]
        for k, ids in enumerate(turns):
            chat.append({"role": "assistant", "content": tok.decode(ids[:-1] if ids[-1] == tok.eos_token_id else ids)})
            if k + 1 < len(turns):
                chat.append({"role": "user", "content": f"ok {start + k + 1}"})
        text, want = tok.decode(ep.prompt_ids + ep.response), render(chat, False)
        if ep in played:
            assert want.startswith(text) and want[len(text):].strip() == "", (family, text, want)


def test_an_episode_spans_a_weight_push_and_each_turn_keeps_its_version(policy, tokenizer, in_process_engines):
    """Partial rollouts (async mode): a push lands between two rounds of an episode; each turn
    records the version that sampled it, and each token's behaviour log-prob is that version's."""
    from hf_reference import hf_logprobs, perturbed_lm
    from transformers import AutoModelForCausalLM

    from learner.transport.base import policy_weights, to_buckets

    old = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    new = perturbed_lm(policy, 0.05, seed=1)
    gen = in_process_engines.hold(Generator(model=policy, partial_rollouts=True,
                                            sampling={"temperature": 1.0, "max_new_tokens": 20},
                                            engine={"max_model_len": 256, "kv_cache_bytes": 16 << 20}))
    rounds = []

    def sample(transcripts, room, keys):
        if len(rounds) == 1:  # after the first round: the learner's next version arrives
            gen.load_weights(1, to_buckets(policy_weights(new.state_dict().items(), tied_embeddings=True), 256 << 10))
        rounds.append(gen.sample_turns(transcripts, room, keys))
        return rounds[-1]

    workers = EnvironmentWorkers("counter_envs:Counter", workers=1, step_timeout_s=30.0)
    try:
        runner = EpisodeRunner(workers=workers, observations=ObservationTokens(tokenizer), decode=tokenizer.decode,
                               max_turns=3, max_tokens=120, max_turn_tokens=20)
        rollouts, _ = runner.play([(tokenizer(p)["input_ids"], 0) for p in PROMPTS], Columns(), tokenizer, 1, sample,
                                  version=gen.version())
    finally:
        workers.close()
    spanning = [r for r in rollouts if r.partial]
    assert len(rounds) >= 2 and spanning
    for i, r in enumerate(rollouts):
        first = len(rounds[0][i].token_ids)  # the first turn: version 0
        assert r.policy_version == 0 and set(r.token_versions[:first]) == {0}
        later = r.token_versions[first:][r.action_mask[first:]]  # later turns (observations: the turn's before)
        assert set(later) <= {1} and r.partial == (first < r.response_ids.size)
        trained = r.action_mask
        for model, v in ((old, 0), (new, 1)):
            at = trained & (r.token_versions == v)
            assert np.abs(hf_logprobs(model, r)[at] - r.behaviour_logprobs[at]).max(initial=0) < 1e-3


class Columns:
    def row(self, index):
        return {"start": 0}


def test_a_truncated_sampler_keeps_each_turns_sets_and_the_learner_scores_them(policy, tokenizer,
                                                                                in_process_engines):
    """top_k / top_p in episodes: each policy token keeps the set vLLM sampled it from, an
    observation's rows none, and the learner (renormalising over those sets) scores the
    policy's tokens as vLLM did; the full softmax does not."""
    import dataclasses

    from learner.batch import collate
    from learner.policy import PolicyWithValueHead

    gen = in_process_engines.hold(Generator(
        model=policy, sampling={"temperature": 1.0, "top_k": 8, "top_p": 0.9, "max_new_tokens": 20},
        engine={"max_model_len": 256, "kv_cache_bytes": 16 << 20}))
    workers = EnvironmentWorkers("counter_envs:Counter", workers=1, step_timeout_s=30.0)
    try:
        runner = EpisodeRunner(workers=workers, observations=ObservationTokens(tokenizer), decode=tokenizer.decode,
                               max_turns=3, max_tokens=120, max_turn_tokens=20)
        rollouts, _ = runner.play([(tokenizer(p)["input_ids"], 0) for p in PROMPTS], Columns(), tokenizer, 2,
                                  gen.sample_turns, version=0)
    finally:
        workers.close()
    for r in rollouts:
        kept = r.kept_ids
        assert kept.shape[0] == r.response_ids.size and (kept[~r.action_mask] == -1).all()
        on = kept[r.action_mask]
        assert all(t in row for t, row in zip(r.response_ids[r.action_mask], on)) and ((on >= 0).sum(1) <= 8).all()
    model = PolicyWithValueHead.from_pretrained(policy, critic="none").eval()
    batch = collate(rollouts, pad_id=tokenizer.pad_token_id)
    with torch.no_grad():
        lp, _, _ = model.response_logprobs_values(batch, with_entropy=False, top_k=8, top_p=0.9)
        full, _, _ = model.response_logprobs_values(dataclasses.replace(batch, kept_ids=None), with_entropy=False)
    trained = batch.response_mask != 0
    assert float((lp - batch.behaviour_logprobs)[trained].abs().max()) < 1e-3
    assert float((full - batch.behaviour_logprobs)[trained].abs().mean()) > 1e-2  # the check can fail

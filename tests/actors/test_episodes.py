"""Multi-turn episodes on the real vLLM CPU engine (actors/episodes.py): the policy's tokens in a
transcript are exactly what vLLM sampled, each observation is exactly its tokenization, the
environment decides the turns, the reward and the end, and the learner scores the policy's
tokens as vLLM did (fp32, 1e-3)."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from actors.env_workers import EnvironmentWorkers
from actors.episodes import EpisodeRunner
from actors.generator import Generator
from actors.transcript import ObservationTokens

sys.path.insert(0, str(Path(__file__).parent))  # tests/actors/counter_envs.py; the env workers get sys.path

pytestmark = pytest.mark.integration

PROMPTS = ["The cat was", "A dog seemed happy", "My friend felt"]


@pytest.fixture(scope="module")
def generator(policy_path):
    return Generator(model=policy_path, sampling={"temperature": 1.0, "max_new_tokens": 8, "n": 1},
                     engine={"max_model_len": 256, "kv_cache_bytes": 16 << 20})


def test_a_transcript_keeps_the_sampled_tokens_and_the_observations_exactly(generator, policy_path, tokenizer):
    from learner.batch import collate
    from learner.policy import PolicyWithValueHead

    observations = ObservationTokens(tokenizer)
    sampled = {}  # (prompt index, sample index, turn) -> the ids vLLM returned

    def sample(transcripts, room, keys):
        turns = generator.sample_turns(transcripts, room, keys)
        sampled.update({key: t.token_ids for key, t in zip(keys, turns)})
        return turns

    workers = EnvironmentWorkers("counter_envs:Counter", workers=2, step_timeout_s=30.0)
    try:
        runner = EpisodeRunner(workers=workers, observations=observations, decode=tokenizer.decode,
                               max_turns=4, max_tokens=80, max_turn_tokens=6)
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
        # Counter ends at its next multiple of 3 with reward 1: 3 turns from 0, 2 from 1, 1 from 2
        assert ep.turns == 3 - start and ep.finish_reason == "stop" and ep.score == 1.0 and mask[-1]
    rollouts = [ep.rollout(version=0) for ep in episodes]
    policy = PolicyWithValueHead.from_pretrained(policy_path, critic="none").eval()
    batch = collate(rollouts, pad_id=tokenizer.pad_token_id)
    with torch.no_grad():
        learner, _, _ = policy.response_logprobs_values(batch, with_entropy=False)
    trained = batch.response_mask != 0
    gap = float((learner - batch.behaviour_logprobs)[trained].abs().max())
    print(f"{int(trained.sum())} policy tokens over {len(rollouts)} transcripts: max |learner - vLLM| = {gap:.1e}")
    assert gap < 1e-3 and int(trained.sum()) == sum(r.trained_tokens for r in rollouts)

"""Rollout token versions and what the batch summary makes of them."""
import dataclasses

import numpy as np
import pytest

from core.rollout import BatchSummary, Rollout, ScoredRollout, shard_rollouts

pytestmark = pytest.mark.unit


def scored(policy_version, token_versions, n=4):
    z = np.zeros(n, np.float32)
    return ScoredRollout(prompt_ids=[1], response_ids=np.arange(n), behaviour_logprobs=z, finish_reason="length",
                         policy_version=policy_version, prompt_index=0, sample_index=0,
                         token_versions=token_versions, reference_logprobs=z, kl=z, rewards=z)


def test_token_versions_default_to_the_policy_version():
    r = Rollout(prompt_ids=[1], response_ids=[2, 3], behaviour_logprobs=[0.0, 0.0], finish_reason="stop",
                policy_version=5, prompt_index=0, sample_index=0)
    assert r.token_versions.tolist() == [5, 5] and not r.partial


@pytest.mark.parametrize("versions, match", [([1, 2], "shape"), ([2, 2, 3, 3], "start at policy_version"),
                                             ([1, 2, 1, 2], "never decrease")])
def test_bad_token_versions_are_refused(versions, match):
    with pytest.raises(ValueError, match=match):
        scored(1, versions)


def test_batch_summary_counts_partial_rollouts_and_token_staleness():
    batch = [scored(1, [1, 1, 2, 2]), scored(2, [2, 2, 2, 2])]
    s = BatchSummary.of(batch, current_version=3)
    assert s.partial.tolist() == [True, False]
    assert s.staleness.tolist() == [2, 1]  # by the oldest token: what the buffer's staleness bound uses
    assert s.token_staleness.tolist() == [1.5, 1.0]


def grouped(keys, lengths=None):
    """ScoredRollouts with the given (chunk_id, prompt_index) keys, in order."""
    out = []
    for i, (chunk, prompt) in enumerate(keys):
        r = scored(0, None, n=(lengths or {}).get(i, 2))
        out.append(dataclasses.replace(r, chunk_id=chunk, prompt_index=prompt, sample_index=i))
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shards_hold_whole_groups_and_every_rollout(world_size):
    # 5 groups of 3, 2, 1, 2, 3 rows (11): the second and third interleaved in the batch.
    keys = [(0, 0)] * 3 + [(0, 1), (1, 5), (0, 1)] + [(1, 7)] * 2 + [(2, 0)] * 3
    rollouts = grouped(keys)
    shards = shard_rollouts(rollouts, world_size)
    assert len(shards) == world_size and all(shards)
    flat = [r.sample_index for s in shards for r in s]
    assert sorted(flat) == list(range(len(rollouts)))  # nothing left out, nothing twice
    owner = {(r.chunk_id, r.prompt_index): k for k, s in enumerate(shards) for r in s}
    assert all(owner[(r.chunk_id, r.prompt_index)] == k for k, s in enumerate(shards) for r in s)  # no group split
    # Groups in order of first appearance, rows in batch order: the shards in rank order.
    assert flat == [0, 1, 2, 3, 5, 4, 6, 7, 8, 9, 10]
    assert [[r.sample_index for r in s] for s in shard_rollouts(rollouts, world_size)] == \
        [[r.sample_index for r in s] for s in shards]  # deterministic
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 3  # within one group (the largest has 3 rows) of each other


def test_shards_balance_rows_and_refuse_too_few_groups():
    rollouts = grouped([(-1, 0)] * 5)  # no chunk: every row is a group of its own
    assert [len(s) for s in shard_rollouts(rollouts, 2)] == [2, 3]
    assert [len(s) for s in shard_rollouts(rollouts, 5)] == [1] * 5
    assert [len(s) for s in shard_rollouts(grouped([(0, 0)] * 4 + [(0, 1)] * 4 + [(0, 2)] * 4), 2)] == [4, 8]
    with pytest.raises(ValueError, match="2 prompt groups cannot give each of 3 ranks one"):
        shard_rollouts(grouped([(0, 0)] * 3 + [(0, 1)] * 3), 3)

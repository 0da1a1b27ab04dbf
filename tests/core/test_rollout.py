"""Rollout token versions and what the batch summary makes of them."""
import numpy as np
import pytest

from core.rollout import BatchSummary, Rollout, ScoredRollout

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

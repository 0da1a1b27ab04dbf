"""The step's metrics row: every key a listed metric (metric_set.py), dynamic sampling's keys only
when it is on, and the learner's transfer figures folded into the step's transfer/* keys."""
from types import SimpleNamespace

import numpy as np
import pytest

from cluster.runtime.observe.metric_set import MEANINGS
from cluster.runtime.observe.produced import Produced
from cluster.runtime.observe.step_row import StepFacts, StepRow
from core.infra.transfer import Transfer
from learner.worker import TO_LEARNER

pytestmark = pytest.mark.unit

SECONDS = {"step": 3.0, "buffer_wait": 0.5, "learn": 1.5, "sync": 0.25}


def _batch(n: int = 8):
    zeros = np.zeros(n)
    return SimpleNamespace(scores=np.arange(n, dtype=float), kl_sums=zeros, response_lengths=zeros + 4,
                           truncated=zeros.astype(bool), buffer_depth=0, dropped_stale=0, staleness=zeros,
                           token_staleness=zeros, partial=zeros, surplus=0, prompt_indices=None, samples=[])


def _row(filter_groups: bool) -> dict:
    facts = StepFacts(kl_beta=0.05, version=3, batches_issued=4, pool_sizes={"generator": 1, "reward": 2},
                      seconds=SECONDS, admission_wait_s=0.0)
    learn = {"ppo/clip_frac": 0.1, **Transfer(40, 1.0, 0).as_metrics(TO_LEARNER)}
    produced = Produced(prompts=2, stored=8, reward_counts={"timeouts": 1})
    return StepRow(filter_groups=filter_groups, columns=None, source_field="source").build(
        _batch(), produced, learn, {}, facts)


def test_every_key_of_the_row_is_a_listed_metric():
    row = _row(filter_groups=True)
    assert set(row) <= set(MEANINGS)
    assert row["kl/beta"] == 0.05 and row["policy/version"] == 3 and row["data/batches_issued"] == 4
    assert row["pool/reward_replicas"] == 2 and row["reward/timeouts"] == 1
    assert row["perf/sync_seconds"] == 0.25  # the push reported no time of its own: the phase's
    assert row["transfer/to_learner_bytes"] == 40 and row["transfer/cross_node_bytes"] == 40


def test_dynamic_sampling_keys_only_when_it_is_on():
    keys = {"rollouts/filtered_frac", "rollouts/extra_generated", "rollouts/surplus"}
    assert keys <= set(_row(filter_groups=True)) and not keys & set(_row(filter_groups=False))

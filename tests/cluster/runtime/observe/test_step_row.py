"""The step's metrics row: every key a listed metric (metric_set.py), dynamic sampling's keys only
when it is on, and the learner's transfer figures folded into the step's transfer/* keys."""
from types import SimpleNamespace

import numpy as np
import pytest

from cluster.runtime.observe.metric_set import MEANINGS
from cluster.runtime.observe.produced import Produced, episode_metrics
from cluster.runtime.observe.step_row import StepFacts, StepRow, decode_sample
from core.infra.transfer import Transfer
from core.rollout import trained_spans
from learner.worker import TO_LEARNER

pytestmark = pytest.mark.unit

SECONDS = {"step": 3.0, "buffer_wait": 0.5, "learn": 1.5, "sync": 0.25}


def _batch(n: int = 8):
    zeros = np.zeros(n)
    return SimpleNamespace(scores=np.arange(n, dtype=float), kl_sums=zeros, response_lengths=zeros + 4,
                           truncated=zeros.astype(bool), buffer_depth=0, dropped_stale=0, staleness=zeros,
                           token_staleness=zeros, partial=zeros, surplus=0, prompt_indices=None, samples=[],
                           components=None)


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


def test_episode_counts_sum_over_calls_and_become_the_episode_and_env_metrics():
    one = {"episodes": 4, "invalid": 1, "turns": 10, "policy_tokens": 60, "env_tokens": 20, "steps": 9,
           "step_seconds": 0.5, "errors": 1, "timeouts": 0, "crashes": 0, "malformed_actions": 0, "lost": 0,
           "tool_calls": 3, "tool_errors": 1}
    merged = Produced(episode_counts=one).merge(Produced(episode_counts={**one, "timeouts": 2}))
    row = episode_metrics(merged.episode_counts)
    assert set(row) <= set(MEANINGS)
    assert row["episode/turns_mean"] == 2.5 and row["episode/env_tokens_frac"] == 0.25
    assert (row["episode/invalid"], row["env/errors"], row["env/timeouts"], row["env/tool_calls"]) == (2, 2, 2, 6)
    assert row["env/steps"] == 18 and row["env/step_seconds"] == 1.0
    assert episode_metrics({}) == {} and "episode/turns_mean" not in _row(filter_groups=False)


class Chars:
    """Decodes id i as chr(i): the transcript's text shows exactly which ids each part holds."""
    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def test_an_episodes_sample_shows_its_turns_and_which_tokens_were_trained():
    mask = np.array([1, 1, 0, 0, 0, 1, 1], dtype=bool)
    versions = np.array([2, 2, 2, 2, 2, 2, 3])  # a push landed inside the second turn
    row = {"prompt_ids": [72, 105], "response_ids": [97, 98, 60, 111, 62, 99, 100], "score": 1.0, "kl_sum": 0.0,
           "finish_reason": "stop", "policy_version": 2, "spans": trained_spans(mask, versions)}
    out = decode_sample(Chars(), row)
    assert out["response"] == "ab<o>cd"
    assert trained_spans(mask, versions) == [[0, 2, True, 2], [2, 5, False, 2], [5, 6, True, 2], [6, 7, True, 3]]
    assert out["transcript"] == [{"by": "policy", "tokens": 2, "version": 2, "text": "ab"},
                                 {"by": "environment", "tokens": 3, "version": 2, "text": "<o>"},
                                 {"by": "policy", "tokens": 1, "version": 2, "text": "c"},
                                 {"by": "policy", "tokens": 1, "version": 3, "text": "d"}]
    assert "transcript" not in decode_sample(Chars(), {k: v for k, v in row.items() if k != "spans"})

"""A reward function in reward.sandbox that hangs on a few pairs: those pairs are invalid, the run
finishes, and the step metrics count them (reward/timeouts, rollouts/invalid_scores)."""
import json

import pytest
from slow_reward import HANGS_PER_NODE

from cluster import train

pytestmark = pytest.mark.e2e


# The slow tier; the default tier: tests/actors/rewards/test_sandbox.py::
# test_a_reward_replica_as_a_ray_actor_scores_through_a_hang_and_a_crash (a real Ray actor).
@pytest.mark.slow
def test_a_sandboxed_reward_that_hangs_on_some_pairs_costs_those_pairs_only(cluster_with_test_rewards, tmp_path):
    rc = train.main([f"run.dir={tmp_path}", "run.name=sandbox", "reward.function=slow_reward:hangs_on_a_few_pairs",
                     "reward.sandbox.workers=2", "reward.sandbox.timeout_s=2", "reward.sandbox.memory_mb=1024",
                     "run.steps=2", "run.eval_every=0", "run.plot_every=0", "run.samples_every=0"])
    assert rc == 0
    steps = [json.loads(line) for line in (tmp_path / "sandbox" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "reward/timeouts" in m]
    assert len(steps) == 2
    timeouts = sum(m["reward/timeouts"] for m in steps)
    assert timeouts == HANGS_PER_NODE  # one Ray node: each hang cost exactly its own pair
    assert sum(m["rollouts/invalid_scores"] for m in steps) == timeouts
    assert sum(m["reward/crashes"] for m in steps) == 0 and all(m["rollouts/used"] > 0 for m in steps)

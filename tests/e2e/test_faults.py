"""Rollout-side replicas die by SIGKILL mid-step; the run goes on and loses no prompt.

Each kill finds the replica's process by the pid it reports through Ray (health()), waits
until the ledger shows a chunk of the step on that replica (generating, or scoring), and
kills it there. A step must then still account for every prompt, the dead replica must be
replaced, and a replacement generator must serve the current weights.
"""
import math
import os
import signal
import threading
import time

import pytest
import ray
from accounting import Accounting

from cluster.config.ppo import DEFAULT_CONFIG
from cluster.runtime.loop.ledger import ChunkState
from cluster.runtime.prepare import prepare

# The chaos test (test_chaos.py) kills each role in the default suite; these pin each case alone.
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture
def driver(cluster_with_test_rewards, tmp_path):
    from cluster.config.ppo import load_config
    from cluster.runtime.loop.driver import Driver
    from cluster.runtime.observe.metrics import RunMetrics
    from cluster.runtime.pools.launch import create_pools

    cfg = load_config(DEFAULT_CONFIG, ["model.dtype=float32", "run.eval_every=0", "run.samples_every=0",
                                             "generator.replicas=2",
                                             "reward.function=slow_reward:slow_sentiment"])
    policy, tokenizer_path, tokenizer, train_set, _ = prepare(cfg)
    pools = create_pools(cfg, policy_path=policy, tokenizer_path=tokenizer_path)
    try:
        with RunMetrics(run_dir=tmp_path, plot_every=0) as metrics:
            yield Driver(cfg, pools=pools, dataset=train_set, eval_dataset=None, tokenizer=tokenizer,
                         metrics=metrics)
    finally:
        pools.shutdown()


class Killer(threading.Thread):
    """SIGKILLs ``replica``'s process as soon as the ledger shows it holding a chunk in ``state``."""

    def __init__(self, driver, pool, replica: str, state: ChunkState, pid: int | None = None):
        super().__init__(daemon=True)
        self.ledger, self.replica, self.state = driver.rollouts.ledger, replica, state
        self.pid = pid or ray.get(pool.handles()[replica].health.remote())["pid"]
        self.fired, self.stop = threading.Event(), threading.Event()

    def run(self):
        while not self.stop.is_set():
            if self._holds():
                os.kill(self.pid, signal.SIGKILL)
                self.fired.set()
                return
            time.sleep(0.002)

    def _holds(self) -> bool:
        if self.state is ChunkState.STORED:  # the buffer holds a chunk
            return self.ledger.held_rollouts() > 0
        return any(c.state is self.state and self.replica in c.replicas.values() for c in self.ledger.in_flight())


def steps_until(driver, killer, max_steps=4):
    """Run steps until the killer has fired (in the step during which it fired), then one more."""
    killer.start()
    out = []
    try:
        while not killer.fired.is_set() and len(out) < max_steps:
            out.append(driver.step())
    finally:
        killer.stop.set()
    assert killer.fired.is_set(), f"{killer.replica} never held a chunk in state {killer.state.value}"
    out.append(driver.step())
    return out


def assert_every_prompt_accounted(m):
    assert m["rollouts/prompts"] == 16
    assert m["rollouts/used"] + 4 * m["rollouts/skipped_prompts"] + m["rollouts/invalid_scores"] \
        + m["rollouts/empty_responses"] == 64


def test_generator_killed_while_generating(driver):
    gens = driver.pools.generators
    driver.step()  # version 1: a replacement must not come up with the initial weights
    steps = steps_until(driver, Killer(driver, gens, "generator-0", ChunkState.GENERATING))
    for m in steps:
        assert_every_prompt_accounted(m)
    assert sum(m["rollouts/redispatched_chunks"] for m in steps) >= 1
    with pytest.raises(ValueError):
        ray.get_actor("generator-0")
    assert sorted(gens.handles()) == ["generator-1", "generator-2"]
    health = ray.get(gens.handles()["generator-2"].health.remote())
    assert health["version"] == driver.version  # pushed the current weights, then kept in sync
    after = driver.step()
    assert after["ppo/logprob_gap_mean"] < 1e-3  # sync mode: every generator ran the learner's weights
    assert ray.get(gens.handles()["generator-2"].health.remote())["generated_tokens"] > 0


def test_reward_killed_while_scoring(driver):
    rewards = driver.pools.rewards
    steps = steps_until(driver, Killer(driver, rewards, "reward-0", ChunkState.SCORING))
    for m in steps:
        assert_every_prompt_accounted(m)
        assert m["rollouts/invalid_scores"] == 0
    assert sum(m["rollouts/redispatched_chunks"] for m in steps) >= 1
    assert list(rewards.handles()) == ["reward-1"]
    assert [m["policy/version"] for m in steps] == list(range(1, len(steps) + 1))


def test_reference_killed_between_steps(driver):
    refs = driver.pools.references
    driver.step()
    os.kill(ray.get(refs.handles()["reference-0"].health.remote())["pid"], signal.SIGKILL)
    m = driver.step()  # the first scoring call of this step meets the dead replica
    assert_every_prompt_accounted(m)
    assert m["rollouts/redispatched_chunks"] >= 1 and list(refs.handles()) == ["reference-1"]
    assert math.isfinite(m["kl/mean"]) and m["policy/version"] == 2


def test_buffer_killed_while_chunks_are_stored(driver):
    """Some chunks are in the buffer, others on their way: all of them are generated again."""
    account = Accounting(driver)
    killer = Killer(driver, None, driver.pools.buffer_slot.id, ChunkState.STORED,
                    pid=ray.get(driver.pools.buffer.health.remote())["pid"])
    steps = steps_until(driver, killer)
    for m in steps:
        assert_every_prompt_accounted(m)
    assert driver.pools.buffer_slot.id == "buffer-1"
    assert sum(m["rollouts/redispatched_chunks"] for m in steps) >= 1
    account.assert_each_prompt_trained_once()
    assert [m["policy/version"] for m in steps] == list(range(1, len(steps) + 1))


def test_buffer_killed_between_rollouts_and_learning(driver):
    """The whole step's rollouts are in the buffer when it dies: the step makes them again."""
    account = Accounting(driver)
    produce = driver.rollouts.produce

    def produce_then_kill(chunks, shaping):
        out = produce(chunks, shaping)
        if chunks:  # the step's own batch, not the regeneration after the kill
            os.kill(ray.get(driver.pools.buffer.health.remote())["pid"], signal.SIGKILL)
        return out

    driver.rollouts.produce = produce_then_kill
    m = driver.step()
    driver.rollouts.produce = produce
    assert_every_prompt_accounted(m)
    assert m["rollouts/redispatched_chunks"] >= 1 and driver.pools.buffer_slot.id == "buffer-1"
    account.assert_each_prompt_trained_once()
    assert driver.step()["policy/version"] == 2


def test_generator_killed_between_rollouts_and_weight_push(driver):
    """The push meets a dead generator: the others get the weights, the step completes, and the
    next step's dispatch replaces the dead one (with the current weights)."""
    gens = driver.pools.generators
    produce = driver.rollouts.produce

    def produce_then_kill(chunks, shaping):
        out = produce(chunks, shaping)
        os.kill(ray.get(gens.handles()["generator-0"].health.remote())["pid"], signal.SIGKILL)
        return out

    driver.rollouts.produce = produce_then_kill
    m = driver.step()
    driver.rollouts.produce = produce
    assert m["policy/version"] == 1 and m["perf/sync_bytes"] > 0
    after = [driver.step() for _ in range(2)]
    assert "generator-0" not in gens.handles() and len(gens) == 2
    assert all(a["ppo/logprob_gap_mean"] < 1e-3 for a in after)
    assert [a["policy/version"] for a in after] == [2, 3]

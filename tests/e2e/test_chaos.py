"""Chaos: SIGKILL one replica of every rollout-side role, and the buffer, at different steps
of one run (sync and async); the run completes, reward rises, and every prompt the data
stream issued is trained on exactly once (or is still in flight when the run ends).

Each victim is found by the pid it reports through Ray, and killed when the ledger shows
it holding work: a generator while it generates, a scorer while it scores, the buffer
while it holds stored rollouts.
"""
import collections
import os
import signal
import threading
import time

import pytest
import ray

from cluster.config.ppo import DEFAULT_CONFIG
from cluster.runtime.loop.ledger import ChunkState
from cluster.runtime.prepare import prepare

pytestmark = pytest.mark.e2e
SAMPLES = 4  # generator.sampling.n of the default config


class Chaos(threading.Thread):
    """Kills, in order, one victim per (step, role): each once the run reached that step and
    the ledger shows the victim holding work. Records (role, step killed, seconds)."""

    PLAN = (("generator", 2, ChunkState.GENERATING), ("reference", 4, ChunkState.SCORING),
            ("reward", 6, ChunkState.SCORING), ("buffer", 8, ChunkState.STORED))

    def __init__(self, driver):
        super().__init__(daemon=True)
        self.driver, self.done, self.kills = driver, threading.Event(), []
        self.ledger = driver.rollouts.ledger

    def _victim(self, role):
        p = self.driver.pools
        if role == "buffer":
            return p.buffer_slot.id, p.buffer
        return next(iter(p.by_role()[role].handles().items()))

    def _holds(self, rid, state):
        if state is ChunkState.STORED:
            return self.ledger.held_rollouts() > 0
        return any(c.state is state and rid in c.replicas.values() for c in self.ledger.in_flight())

    def run(self):
        for role, step, state in self.PLAN:
            while self.driver.step_count < step and not self.done.is_set():
                time.sleep(0.01)
            rid, handle = self._victim(role)
            pid = ray.get(handle.health.remote())["pid"]
            deadline = time.monotonic() + 120
            while not self._holds(rid, state):
                if self.done.is_set() or time.monotonic() > deadline:
                    return
                time.sleep(0.002)
            self.kills.append((role, rid, self.driver.step_count, time.perf_counter()))
            os.kill(pid, signal.SIGKILL)


# Async in the default suite (the harder case: the producer runs while the buffer dies);
# sync, which also proves replacements serve the learner's weights (logprob gap), is slow.
@pytest.mark.parametrize("mode", [pytest.param("sync", marks=pytest.mark.slow), "async"])
def test_kill_every_rollout_role_once(cluster_with_test_rewards, tmp_path, mode):
    from cluster.config.ppo import load_config
    from cluster.runtime.loop.driver import Driver
    from cluster.runtime.observe.metrics import RunMetrics
    from cluster.runtime.pools.launch import create_pools

    cfg = load_config(DEFAULT_CONFIG, ["model.dtype=float32",  # the 1e-3 log-prob gap check below
        "run.eval_every=0", "run.samples_every=0", "run.plot_every=0", "run.steps=12", f"run.mode={mode}",
        "reward.replicas=2", "reward.function=slow_reward:slow_sentiment"])  # scoring lasts long enough to be hit
    policy, tokenizer_path, tokenizer, train_set, _ = prepare(cfg)
    pools = create_pools(cfg, policy_path=policy, tokenizer_path=tokenizer_path)
    metrics = RunMetrics(run_dir=tmp_path, plot_every=0)
    driver = Driver(cfg, pools=pools, dataset=train_set, eval_dataset=None, tokenizer=tokenizer, metrics=metrics)
    issued, trained = collections.Counter(), collections.Counter()
    issue, consumed = driver.prompts.issue, driver.rollouts.ledger.consumed

    def noting_issue():
        chunks = issue()
        issued.update(i for c in chunks for i in c.prompt_indices)
        return chunks

    def noting_consumed(pairs):
        trained.update(i for _, i in pairs)
        consumed(pairs)

    driver.prompts.issue, driver.rollouts.ledger.consumed = noting_issue, noting_consumed
    chaos = Chaos(driver)
    chaos.start()
    try:
        t0 = time.perf_counter()
        driver.run()
        seconds = time.perf_counter() - t0
        chaos.done.set()
        chaos.join(10)
        unfinished = collections.Counter(driver.rollouts.ledger.unfinished_prompts())
    finally:
        metrics.close()
        pools.shutdown()
    print(f"\n{mode}: 12 steps in {seconds:.0f}s; kill -> detected / replacement serving (s):")
    for (role, rid, step, killed), rec in zip(chaos.kills, driver.rollouts.recoveries):
        assert rec["replica"] == rid
        print(f"  {role:9s} at step {step:2d}: {rec['detected'] - killed:5.2f} / {rec['serving'] - killed:5.2f}")
    assert [k[0] for k in chaos.kills] == ["generator", "reference", "reward", "buffer"]
    assert [r["role"] for r in driver.rollouts.recoveries] == ["generator", "reference", "reward", "buffer"]
    rows = [r for r in map(__import__("json").loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
            if r["step"] > 0]
    assert [r["policy/version"] for r in rows] == list(range(1, 13))
    assert sum(r["rollouts/redispatched_chunks"] for r in rows) >= 4
    assert all(r["rollouts/skipped_prompts"] == 0 and r["rollouts/invalid_scores"] == 0 for r in rows)
    if mode == "sync":  # replacement generators served the learner's current weights from the start
        assert all(r["ppo/logprob_gap_mean"] < 1e-3 for r in rows)
    rewards = [r["reward/mean"] for r in rows]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3  # it still learns
    # Exactly once: each issued prompt's samples were all taken by the learner (trained, or in
    # async mode possibly dropped as stale), none twice; only the last in-flight prompts are short.
    for prompt, times in issued.items():
        done = times - unfinished[prompt]
        assert done * SAMPLES <= trained[prompt] <= times * SAMPLES, (prompt, times, trained[prompt])
    assert set(trained) <= set(issued)
    assert driver.pools.buffer_slot.id == "buffer-1"

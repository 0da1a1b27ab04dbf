"""A learner rank dies mid-run; the run rolls back to its last checkpoint and goes on.

The rank is SIGKILLed by the pid it reports through Ray, while the group is inside a
learner call (train), at a step after a checkpoint. The run must detect it in seconds,
rebuild the group, restore the checkpoint (step, version, data position, KL beta),
give the generators the restored weights, and finish; the metrics file then holds each
step exactly once.
"""
import json
import os
import signal
import threading
import time

import pytest
import ray

from cluster import train

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=8, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


def make_driver(tmp_path, *overrides):
    from cluster.config import load_config
    from cluster.driver import Driver
    from cluster.metrics import RunMetrics
    from cluster.pools import create_pools

    cfg = load_config(train.DEFAULT_CONFIG, ["run.eval_every=0", "run.samples_every=0", "run.plot_every=0",
                                             *overrides])
    policy, tokenizer_path, tokenizer, train_set, _ = train.prepare(cfg)
    pools = create_pools(cfg, policy_path=policy, tokenizer_path=tokenizer_path)
    metrics = RunMetrics(run_dir=tmp_path, plot_every=0)
    return Driver(cfg, pools=pools, dataset=train_set, eval_dataset=None, tokenizer=tokenizer,
                  metrics=metrics), pools, metrics


class KillRank:
    """Wraps one learner-group call (train: the PPO epochs; push_weights: the weight sync):
    at ``at_step`` it SIGKILLs ``rank`` while that call runs (``delay_s`` into it), or just as
    it is sent (``delay_s=0``)."""

    def __init__(self, driver, *, phase: str, rank: int, at_step: int, delay_s: float = 0.05):
        self.group, self.rank, self.at_step, self.delay_s = driver.pools.learner, rank, at_step, delay_s
        self.driver, self.killed_at = driver, None
        call = {"train": self.group.train, "push_weights": self.group.push_weights}[phase]

        def wrapped(*args, **kwargs):
            self._maybe_kill()
            return call(*args, **kwargs)

        setattr(self.group, phase, wrapped)

    def _maybe_kill(self):
        if self.killed_at is None and self.driver.step_count + 1 == self.at_step:
            pid = self.group.pids()[self.rank]

            def kill():
                self.killed_at = time.perf_counter()
                os.kill(pid, signal.SIGKILL)

            if self.delay_s == 0:
                # The weight push can finish before a kill from another thread lands (then the
                # death is found at the checkpoint save instead). Killed here, just before the
                # call goes out, the push is always the call that finds the rank dead, while
                # rank 0 runs its part of it and waits in the collective.
                kill()
                return

            def kill_later():
                time.sleep(self.delay_s)  # let the (seconds-long) call start on every rank first
                kill()

            threading.Thread(target=kill_later, daemon=True).start()


# CI budget: the sync/train kill is slow; the async kill during the weight push stays in the default suite.
@pytest.mark.parametrize("mode, phase", [pytest.param("sync", "train", marks=pytest.mark.slow), ("async", "push_weights")])
def test_learner_rank_killed_mid_step_rolls_back_and_finishes(cluster, tmp_path, mode, phase):
    driver, pools, metrics = make_driver(tmp_path, "learner.replicas=2", "run.steps=5",
                                         "run.checkpoint_every=2", f"run.mode={mode}")
    try:
        killer = KillRank(driver, phase=phase, rank=1, at_step=4, delay_s=0.05 if phase == "train" else 0.0)
        final = driver.run()
        metrics.close()
        assert killer.killed_at is not None
        [rb] = driver.rollbacks
        assert rb["rank"] == 1 and rb["resumed_at_step"] == 2 and rb["failed_at_step"] == 3
        detected = rb["detected_at"] - killer.killed_at
        print(f"\n{mode}: rank 1 killed in {phase} at step 4: detected in {detected:.2f}s, "
              f"learner rebuilt in {rb['rebuild_seconds']:.1f}s, back at step 2 after "
              f"{rb['recovery_seconds']:.1f}s")
        assert detected < 10
        assert driver.step_count == 5 and final["policy/version"] == 5
        rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]  # each step once, the lost ones redone
        assert [r["data/batches_issued"] for r in rows[1:4]] == [1, 2, 3] if mode == "sync" else True
        if mode == "sync":  # the generators run exactly the restored-then-trained weights
            assert final["ppo/logprob_gap_mean"] < 1e-3
        gens = pools.generators.handles()
        assert {ray.get(g.health.remote())["version"] for g in gens.values()} == {5}
    finally:
        pools.shutdown()

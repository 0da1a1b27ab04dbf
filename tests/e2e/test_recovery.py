"""A learner rank dies mid-run; the run rolls back to its last checkpoint and goes on.

The rank is SIGKILLed by the pid it reports through Ray, during or just as a learner call goes
out, at a step after a checkpoint. The run must detect it in seconds, rebuild the group,
restore the checkpoint (learner state, step, version, data position, unfinished prompts, KL
beta), give the generators the restored weights, and finish; the metrics file then holds each
step exactly once. Each of those is checked against what the run did (``Trail``), not only
that it ended.
"""
import itertools
import json
import os
import signal
import threading
import time

import pytest
import ray

from cluster.config.ppo import DEFAULT_CONFIG
from cluster.runtime.prepare import prepare
from core.kl import AdaptiveKLController

pytestmark = pytest.mark.e2e


def make_driver(tmp_path, *overrides):
    from cluster.config.ppo import load_config
    from cluster.runtime.loop.driver import Driver
    from cluster.runtime.observe.metrics import RunMetrics
    from cluster.runtime.pools.launch import create_pools

    cfg = load_config(DEFAULT_CONFIG, ["model.dtype=float32", "run.eval_every=0", "run.samples_every=0",
                                             "run.plot_every=0",
                                             *overrides])
    policy, tokenizer_path, tokenizer, train_set, _ = prepare(cfg)
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
        self.driver, self.killed_at, self.reported = driver, None, []
        self._reported = threading.Event()
        call = {"train": self.group.train, "push_weights": self.group.push_weights}[phase]

        def wrapped(*args, **kwargs):
            self._maybe_kill()
            return call(*args, **kwargs)

        setattr(self.group, phase, wrapped)

    def _maybe_kill(self):
        if self.killed_at is None and self.driver.step_count + 1 == self.at_step:
            pid, worker = self.group.pids()[self.rank], self.group.workers[self.rank]

            def kill():
                self.killed_at = time.perf_counter()
                os.kill(pid, signal.SIGKILL)
                threading.Thread(target=self._watch, args=(worker,), daemon=True).start()

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

    def _watch(self, worker) -> None:
        """Records when Ray reports the killed rank dead to this process: a call to it fails."""
        from ray.exceptions import RayActorError

        while True:
            try:
                ray.get(worker.health.remote())  # queued behind the call in flight, or answered before the kill lands
            except RayActorError:
                self.reported.append(time.perf_counter())
                self._reported.set()
                return
            time.sleep(0.02)

    def death_reported_at(self, timeout_s: float = 120.0) -> float:
        """When Ray reported the killed rank dead (perf_counter), as this process saw it."""
        assert self._reported.wait(timeout_s), f"Ray did not report rank {self.rank} dead within {timeout_s:.0f}s"
        return self.reported[0]


def run_with_kill(driver, metrics, killer, *, failed_at: int, resumed_at: int, what: str):
    """driver.run() with ``killer`` armed: the killed rank is found as Ray reports its death and
    the run rolls back once, from step ``failed_at`` to the checkpoint of step ``resumed_at``.
    Returns the last step's metrics and the rows of metrics.jsonl."""
    final = driver.run()
    metrics.close()
    assert killer.killed_at is not None
    [rb] = driver.rollbacks
    assert (rb["rank"], rb["failed_at_step"], rb["resumed_at_step"]) == (killer.rank, failed_at, resumed_at)
    rows = [json.loads(line) for line in (metrics.run_dir / "metrics.jsonl").read_text().splitlines()]
    # The run found the death when Ray reported it (or sooner), not at a timeout of its own (the
    # survivors' collectives fail only at learner.dist_timeout_s): within one step of the report,
    # a healthy step of this run before the kill, so the machine's speed cancels out.
    late = rb["detected_at"] - killer.death_reported_at()
    healthy = min(r["perf/step_seconds"] for r in rows[1:resumed_at + 1])
    print(f"\n{what}: detected {rb['detected_at'] - killer.killed_at:.2f}s after the kill ({late:+.2f}s after "
          f"Ray reported it; a healthy step {healthy:.1f}s), learner rebuilt in {rb['rebuild_seconds']:.1f}s, "
          f"back at step {resumed_at} after {rb['recovery_seconds']:.1f}s")
    assert late < healthy, (late, healthy)
    return final, rows


class Trail:
    """What the run did, recorded from the driver's side: each batch drawn from the prompt stream
    (with its ledger chunk ids), each take's consumed (chunk, prompt) pairs, the summary of each
    batch taken, and the checkpoint state each rollback restored. ``timeline`` counts the
    rollbacks so far: 0 is the run before the first, whose steps after the checkpoint are redone."""

    def __init__(self, driver):
        self.draws, self.takes, self.restored = [], [], []
        self.issued_chunks: set = set()
        issue, take, restore = driver.prompts.issue, driver._take, driver.restore

        def issue_and_note():
            chunks = issue()
            self.issued_chunks |= {c.id for c in chunks}
            self.draws.append((len(self.restored), [i for c in chunks for i in c.prompt_indices]))
            return chunks

        def take_and_note():
            shards, batch = take()
            self.takes.append({"timeline": len(self.restored), "step": driver.step_count + 1,
                               "consumed": list(batch.consumed), "reward_mean": float(batch.scores.mean()),
                               "kl_mean": float(batch.kl_sums.mean())})
            return shards, batch

        def restore_and_note(path):
            from cluster.runtime.state import checkpoint
            self.restored.append(checkpoint.load_state(path))
            return restore(path)

        driver.prompts.issue, driver._take, driver.restore = issue_and_note, take_and_note, restore_and_note
        self.stream = [sorted(int(i) for i in indices) for indices, _, _ in
                       itertools.islice(driver.dataset.batches(driver.cfg.data.prompts_per_step, epochs=None), 64)]

    def drawn(self, timeline: int) -> list:
        return [sorted(d) for t, d in self.draws if t == timeline]

    def consumed(self, timeline: int, *, before_step=None, requeued=False) -> set:
        """Prompts the takes of ``timeline`` reported (those of steps before ``before_step``);
        ``requeued``: only those of chunks no draw opened (a restore re-queued them)."""
        return {p for t in self.takes if t["timeline"] == timeline and (before_step is None or t["step"] < before_step)
                for c, p in t["consumed"] if not requeued or c not in self.issued_chunks}


def checkpoint_with_a_batch_in_flight(driver, *, step: int):
    """Async: the checkpoint of ``step`` is taken once the producer has drawn the next batch, so
    it holds unfinished prompts for the rollback to generate again. (With max_staleness=0 the
    producer may draw that batch only after the step's weights are published, which races the
    checkpoint written just after.)"""
    run_state = driver.run_state

    def once_drawn():
        if driver.step_count == step:
            deadline = time.monotonic() + 60
            while not driver.rollouts.ledger.unfinished_prompts():
                assert time.monotonic() < deadline, f"the producer drew no batch after step {step}'s push"
                time.sleep(0.01)
        return run_state()

    driver.run_state = once_drawn


def assert_rolled_back_to(trail, driver, rows, ckpt_step: int, mode: str):
    """What the rollback restored, as the run went on from it."""
    [state] = trail.restored
    assert state.step == ckpt_step
    # Data position: the run drew batches 0, 1, ... and after the rollback draws again from the
    # checkpoint's position in the (deterministic) stream, not from where the lost steps left it.
    before, after = trail.drawn(0), trail.drawn(1)
    assert before == trail.stream[:len(before)] and len(before) > state.batches_issued
    assert after, "no batch drawn after the rollback"
    assert after == trail.stream[state.batches_issued:state.batches_issued + len(after)]
    if mode == "sync":
        assert [r["data/batches_issued"] for r in rows[1:]] == list(range(1, len(rows)))
        assert state.unfinished == ()
    else:
        # The prompts drawn before the checkpoint but not yet trained on (async: in flight or
        # buffered then) are generated again after the rollback: consumed there, or still in
        # flight at the end; and none the run had trained on before the checkpoint comes back.
        requeued = trail.consumed(1, requeued=True)
        assert state.unfinished, "async: the checkpoint was taken with a batch in flight"
        assert set(state.unfinished) <= requeued | set(driver.rollouts.ledger.unfinished_prompts())
        assert not requeued & trail.consumed(0, before_step=ckpt_step + 1)
    # KL beta: each step's beta is the controller's update of the previous step's, from the
    # batch's KL; the first step after the rollback starts from the checkpoint's beta (the
    # lost steps had moved it on).
    kl = driver.cfg.ppo.kl
    assert kl.target, "the default config's KL controller is adaptive: beta moves every step"
    beta = kl.beta
    for r in rows[1:]:
        ctl = AdaptiveKLController(beta, kl.target, kl.horizon)
        ctl.update(r["kl/mean"], n_steps=r["rollouts/used"])
        assert r["kl/beta"] == pytest.approx(ctl.value, rel=1e-9), f"step {r['step']}"
        beta = r["kl/beta"]
    assert rows[ckpt_step]["kl/beta"] == pytest.approx(state.kl_beta, rel=1e-9)
    # Learner: the optimizer state came back with the weights (its step counter too).
    steps = len(rows) - 1
    assert [h["step"] for h in driver.pools.learner.health()] == [steps] * driver.pools.learner.world_size
    # Generators: every trained rollout was sampled by exactly the learner's weights of its
    # version (sync mode; async with max_staleness=0), so a generator left with the lost
    # steps' weights shows here.
    assert all(r["ppo/logprob_gap_mean"] < 1e-3 for r in rows[1:]), [r["ppo/logprob_gap_mean"] for r in rows[1:]]


# The sync kill in train is in the slow tier; the default tier: the async kill during the weight push
# (below) and test_the_only_learner_rank_killed_rolls_back_and_redoes_the_same_step (a kill in train).
@pytest.mark.parametrize("mode, phase", [pytest.param("sync", "train", marks=pytest.mark.slow),
                                         ("async", "push_weights")])
def test_learner_rank_killed_mid_step_rolls_back_and_finishes(cluster, tmp_path, mode, phase):
    # max_staleness=0: async mode then trains only on rollouts of the learner's current weights,
    # so the log-prob gap checks the generators' weights in both modes.
    driver, pools, metrics = make_driver(tmp_path, "learner.replicas=2", "run.steps=5",
                                         "run.checkpoint_every=2", f"run.mode={mode}", "buffer.max_staleness=0")
    try:
        trail = Trail(driver)
        if mode == "async":
            checkpoint_with_a_batch_in_flight(driver, step=2)
        killer = KillRank(driver, phase=phase, rank=1, at_step=4, delay_s=0.05 if phase == "train" else 0.0)
        final, rows = run_with_kill(driver, metrics, killer, failed_at=3, resumed_at=2,
                                    what=f"{mode}: rank 1 killed in {phase} at step 4")
        assert driver.step_count == 5 and final["policy/version"] == 5
        assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]  # each step once, the lost ones redone
        assert_rolled_back_to(trail, driver, rows, 2, mode)
        gens = pools.generators.handles()
        assert {ray.get(g.health.remote())["version"] for g in gens.values()} == {5}
    finally:
        pools.shutdown()


def test_the_only_learner_rank_killed_rolls_back_and_redoes_the_same_step(cluster, tmp_path):
    """The default learner: one rank, so nothing survives its death (rank 0 of 1). Killed as
    step 3's PPO update goes out (its rollouts made, the checkpoint of step 2 on disk), the run
    rebuilds the rank from the checkpoint and redoes step 3 from the same place: the same
    prompts, sampled by the same restored weights with the same per-prompt seeds, so the batch
    it trains on is the one the lost attempt had drawn."""
    driver, pools, metrics = make_driver(tmp_path, "learner.replicas=1", "run.steps=3", "run.checkpoint_every=2",
                                         "run.mode=sync")
    try:
        trail = Trail(driver)
        killer = KillRank(driver, phase="train", rank=0, at_step=3, delay_s=0.0)
        final, rows = run_with_kill(driver, metrics, killer, failed_at=2, resumed_at=2,
                                    what="rank 0 of 1 killed in train at step 3")
        assert driver.step_count == 3 and final["policy/version"] == 3
        assert [r["step"] for r in rows] == [0, 1, 2, 3]
        # Step 3 twice: the lost attempt's batch (taken, then the rank died) and the redo's.
        lost, redo = [t for t in trail.takes if t["step"] == 3]
        assert (lost["timeline"], redo["timeline"]) == (0, 1)
        assert trail.drawn(0)[2] == trail.drawn(1)[0]  # the same prompts
        assert sorted(p for _, p in redo["consumed"]) == sorted(p for _, p in lost["consumed"])
        # the same samples: scores and KL to the reference of the batch match the lost attempt's
        assert redo["reward_mean"] == pytest.approx(lost["reward_mean"], abs=1e-6)
        assert redo["kl_mean"] == pytest.approx(lost["kl_mean"], abs=1e-6)
        assert rows[3]["reward/mean"] == pytest.approx(lost["reward_mean"], abs=1e-6)
        assert_rolled_back_to(trail, driver, rows, 2, "sync")
        gens = pools.generators.handles()
        assert {ray.get(g.health.remote())["version"] for g in gens.values()} == {3}
    finally:
        pools.shutdown()

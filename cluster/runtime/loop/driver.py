"""The PPO loop: prompts -> rollouts -> scores -> buffer -> learner -> weights -> generators.

One step, as `step()` reads:
    rollouts  the step producer fills the buffer (cluster/runtime/loop/producers.py; sync: this
              step's prompts now, async: a producer thread all along)
    batch     take the learner's shards from the buffer, by reference, plus a summary for metrics
    learn     the PPO epochs on the learner group
    sync      update the KL controller from the batch, push the new weights, bump the version

Sync mode is on-policy: each step's rollouts come from the current version and the
next generation waits for the weight push. Async mode keeps generating while the
learner trains; the buffer drops rollouts more than `buffer.max_staleness` versions old.
The driver holds object references and small summaries only; rollouts never pass through it.

Beside the loop, in their own modules: the prompt stream (cluster/runtime/loop/prompt_stream.py),
recovery (cluster/runtime/loop/recovery.py; a dead rollout-side replica or buffer is handled where the
rollouts are made, cluster/runtime/loop/dispatch.py), the step's metrics row (cluster/runtime/observe/step_row.py),
scaling between steps (cluster/runtime/loop/scaling.py) and evaluation (cluster/runtime/loop/evaluation.py).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path

import numpy as np
import ray
from ray.exceptions import RayActorError

from cluster.config.ppo import TetherConfig
from cluster.runtime.loop import evaluation, recovery, scaling
from cluster.runtime.loop.dispatch import ChunkDispatcher
from cluster.runtime.loop.producers import PRODUCERS
from cluster.runtime.loop.prompt_stream import PromptStream
from cluster.runtime.loop.recovery import Recovery
from cluster.runtime.loop.reward_check import check_invalid_scores
from cluster.runtime.observe.alarms import OveroptimizationAlarm
from cluster.runtime.observe.metrics import RayMetrics, RunMetrics, progress_line
from cluster.runtime.observe.produced import Produced, kept_set_warning
from cluster.runtime.observe.step_row import StepFacts, StepRow, decode_sample
from cluster.runtime.pools.pool import Pools, alive
from cluster.runtime.pools.threads import chunks_per_generator
from cluster.runtime.state import checkpoint
from cluster.runtime.state.checkpoint import RunState
from core.annotate import RewardShaping
from core.infra.files import publish_dir
from core.infra.weights import WEIGHT_UPDATE_GROUP
from core.kl import AdaptiveKLController, FixedKLController, KLPenalty
from learner.group import LearnerRankDied

TAKE_POLL_S = 1.0  # how often a take waiting in the buffer looks for a failed producer

log = logging.getLogger("tether")


class PhaseTimer:
    """Named wall-clock phases of one step: ``with timer("learn"): ...`` -> perf/learn_seconds."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0


class Driver:
    def __init__(self, cfg: TetherConfig, *, pools: Pools, dataset, eval_dataset, tokenizer,
                 metrics: RunMetrics, ptx=None, control=None) -> None:
        self.cfg, self.pools, self.tokenizer, self.metrics = cfg, pools, tokenizer, metrics
        self.control = control  # a RunControl actor (cluster/runtime/pools/control.py), or None
        self.dataset, self.eval_dataset = dataset, eval_dataset
        self.ptx = ptx  # cluster.data.ptx.PTXData when ppo.ptx_coef > 0
        kl = cfg.ppo.kl
        self.kl_ctl = (AdaptiveKLController(kl.beta, kl.target, kl.horizon) if kl.target
                       else FixedKLController(kl.beta))
        self.ray_metrics = RayMetrics()
        self.alarm = OveroptimizationAlarm(cfg.run.alarm_window)
        self.step_count = self.version = 0
        # Learner calls are collectives: two threads (async mode's producer replacing a dead
        # generator, the main loop training) must not interleave them differently per rank.
        self._learner_lock = threading.Lock()
        self.rollouts = ChunkDispatcher(pools, put_timeout_s=cfg.buffer.timeout_s,
                                        chunks_per_generator=chunks_per_generator(cfg),
                                        on_new_generator=self._give_current_weights,
                                        filter_groups=cfg.ppo.filter_groups)
        self.prompts = PromptStream(dataset=dataset, prompts_per_step=cfg.data.prompts_per_step,
                                    rollouts=self.rollouts)
        # The one place the run's mode is read: the step below calls the producer whichever it is.
        self.producer = PRODUCERS[cfg.run.mode](cfg, rollouts=self.rollouts, prompts=self.prompts,
                                                shaping=self.shaping)
        self.recovery = Recovery(run=self, pools=pools, rollouts=self.rollouts, producer=self.producer,
                                 learner_lock=self._learner_lock, run_dir=metrics.run_dir,
                                 placement_timeout_s=cfg.resources.placement_timeout_s)
        self.step_row = StepRow(filter_groups=cfg.ppo.filter_groups, columns=dataset.columns,
                                source_field=cfg.data.source_field)
        self.stop_requested = threading.Event()  # set by SIGTERM/SIGINT: stop at the next step boundary
        self.rollbacks: list[dict] = []          # one record per learner recovery
        self.startup_metrics: dict = {}          # perf/startup_* of the process that built the pools (step 0)

    def kl_penalty(self) -> KLPenalty:
        """The KL penalty with beta as the controller has it now: the learner's once per step; the
        producer's (through ``shaping``) each time it produces, since in async mode the rollouts
        produced after an update take that update's beta."""
        kl = self.cfg.ppo.kl
        return KLPenalty(beta=self.kl_ctl.value, estimator=kl.estimator, placement=kl.placement)

    def shaping(self) -> RewardShaping:
        """How the rollouts scored now get their per-token rewards."""
        p = self.cfg.ppo
        return RewardShaping.for_step(self.kl_penalty(), truncation_penalty=p.truncation_penalty,
                                      reward_clip=p.reward_clip)

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict:
        cfg, final = self.cfg, {}
        if self.step_count == 0:
            eval_metrics = self.evaluate() if cfg.run.eval_every else {}
            self.metrics.log(0, {**self.startup_metrics, **eval_metrics})
            log.info("step 0: eval %s", " ".join(f"{k}={v:.3f}" for k, v in eval_metrics.items()))
        self.producer.start()
        t_start = time.perf_counter()
        try:
            while self.step_count < cfg.run.steps and not self.stop_requested.is_set():
                scaling.apply_requested(self.control, self.pools, on_new_generator=self._give_current_weights)
                try:
                    metrics = self.step()
                    self._after_step(metrics)
                except LearnerRankDied as e:
                    self.rollbacks.append(self.recovery.roll_back(e))
                    continue
                log.info(progress_line(self.step_count, cfg.run.steps, metrics, time.perf_counter() - t_start))
                final = metrics
        finally:
            self.producer.stop(at_end=True)
        return final

    def step(self) -> dict:
        """One PPO step: the producer's rollouts, the take, the update and the weight push."""
        timer = PhaseTimer()
        with timer("step"):
            self.producer.fill(self.step_count + 1)  # prompts -> rollouts -> scores -> buffer
            with timer("buffer_wait"):  # buffer -> the learner's shards
                shards, batch = self._take()
            produced = self.producer.for_step(batch.consumed)
            check_invalid_scores(produced, self.cfg, self.step_count + 1)  # async: what fed this step
            if warning := kept_set_warning(produced):  # one line per step, and only when it happens
                log.warning(warning)
            with timer("learn"), self._learner_lock:  # learner
                learn = self.pools.learner.train(shards, ptx_rows=self.ptx_rows(), kl=self.kl_penalty())
            with timer("sync"), self._learner_lock:  # weights -> generators
                sync = self._publish(batch)
        return self._step_metrics(batch, produced, learn, sync, timer.seconds)

    def _take(self):
        """The learner's shards and the buffer's summary of them. A buffer that died is replaced
        and what it held generated again (by the producer)."""
        cfg, world = self.cfg, self.pools.learner.world_size
        min_version = self.producer.min_version(self.version)
        while True:
            self.producer.requeue_lost_buffer()  # here, in the thread that applies `consumed`
            n, trim = self.producer.take_size(cfg.rollouts_per_step)
            if n == 0:
                raise RuntimeError(f"version {self.version}: no usable rollouts (all prompts skipped or all "
                                   "scores invalid); check data.max_prompt_tokens and the reward")
            slot = self.pools.buffer_slot
            buffer_id, buffer = slot.id, slot.handle
            try:
                *shards, summary_ref = buffer.take.options(num_returns=world + 1).remote(
                    n, world_size=world, min_version=min_version, current_version=self.version,
                    timeout=cfg.buffer.timeout_s, drop_surplus=trim)
                batch = self._wait_for_take(summary_ref)
            except RayActorError:
                if alive(buffer):
                    raise
                self.rollouts.buffer_died(buffer_id)
                continue
            self.rollouts.ledger.consumed(batch.consumed)
            return shards, batch

    def _wait_for_take(self, summary_ref):
        """The take's summary; while the buffer waits for rollouts, a producer that failed ends
        the wait with its error (else the take would sit out the buffer's whole timeout)."""
        while not ray.wait([summary_ref], timeout=TAKE_POLL_S, fetch_local=True)[0]:
            self.producer.check()
        return ray.get(summary_ref)

    def ptx_rows(self):
        """This step's PTX rows: ptx.batch_size per optimizer step of the update, chosen by the
        step number (so a resumed or rolled-back run mixes in the same text)."""
        if self.ptx is None:
            return None
        c = self.cfg
        minibatches = -(-c.rollouts_per_step // c.ppo.minibatch_size)
        return self.ptx.rows_for_step(self.step_count, c.ppo.ppo_epochs * minibatches * c.ptx.batch_size)

    def _publish(self, batch) -> dict:
        """After the update: the KL controller sees the batch and the generators get the next version."""
        self.kl_ctl.update(float(batch.kl_sums.mean()), n_steps=len(batch.scores))
        sync = recovery.push_weights(self.pools.learner, self.pools.generators.handles(), self.version + 1)
        self.version += 1
        self.step_count += 1
        self.producer.published()
        return sync

    def _after_step(self, metrics: dict) -> None:
        """The step's evaluation, alarm, HF checkpoint, metrics row and resumable checkpoint, as due."""
        cfg, step = self.cfg, self.step_count
        if cfg.run.eval_every and (step % cfg.run.eval_every == 0 or step == cfg.run.steps):
            metrics.update(self.evaluate())
        metrics.update(self.alarm.update(step, metrics))
        if cfg.run.save_every and step % cfg.run.save_every == 0:
            self.save_checkpoint(f"step-{step}")
        self.metrics.log(step, metrics)  # also records the Ray gauges
        if cfg.run.checkpoint_every and step % cfg.run.checkpoint_every == 0:
            self.checkpoint()

    def _step_metrics(self, batch, produced: Produced, learn: dict, sync: dict, seconds: dict) -> dict:
        """The step's row, its Ray gauges, and its samples when due."""
        facts = StepFacts(kl_beta=self.kl_ctl.value, version=self.version, batches_issued=self.prompts.batches_issued,
                          pool_sizes=self.pools.sizes(), seconds=seconds,
                          admission_wait_s=self.producer.admission_wait_seconds())
        m = self.step_row.build(batch, produced, learn, sync, facts)
        for g, tps in produced.per_generator_tps.items():
            self.ray_metrics.record({"generator/tokens_per_s": tps}, {"pool": "generator", "replica": g})
        for pool, lat in produced.score_latency.items():
            self.ray_metrics.record({"score/seconds": float(np.mean(lat))}, {"pool": pool})
        if self.cfg.run.samples_every and self.version % self.cfg.run.samples_every == 0:
            self.metrics.samples(self.version, [decode_sample(self.tokenizer, row, self.dataset.columns)
                                                for row in batch.samples])
        return m

    # ------------------------------------------------------------------ checkpoints
    def run_state(self) -> RunState:
        batches_issued, unfinished = self.prompts.position()
        return RunState(step=self.step_count, version=self.version, batches_issued=batches_issued,
                        unfinished=unfinished, kl_beta=self.kl_ctl.value, pinned=checkpoint.pinned_values(self.cfg),
                        pool_sizes=self.pools.sizes())

    def checkpoint(self) -> Path:
        """A resumable checkpoint of this step (learner + driver state), written atomically."""
        t0 = time.perf_counter()
        with self._learner_lock:
            path = checkpoint.save(self.metrics.run_dir, self.run_state(), self.pools.learner,
                                   keep=self.cfg.run.keep_checkpoints)
        log.info("checkpoint: %s (%.1fs)", path, time.perf_counter() - t0)
        return path

    def restore(self, path: Path | None) -> RunState:
        """Learner and driver back to checkpoint ``path`` (None: the start of the run), and the
        generators given its weights. The producer must be stopped."""
        state = checkpoint.load_state(path) if path else RunState(
            step=0, version=0, batches_issued=0, unfinished=(), kl_beta=self.cfg.ppo.kl.beta, pinned={})
        with self._learner_lock:
            if path:
                self.pools.learner.load(Path(path) / "learner")
            generators = recovery.live_generators(self.pools.generators.handles())  # the producer replaces the rest
            ray.get([g.rewind.options(concurrency_group=WEIGHT_UPDATE_GROUP).remote(state.version)
                     for g in generators.values()])
            recovery.push_weights(self.pools.learner, generators, state.version)
        self.step_count, self.version, self.kl_ctl.value = state.step, state.version, state.kl_beta
        self.producer.published()  # nothing taken at the restored version yet
        self.prompts.seek(state.batches_issued)
        if state.unfinished:  # async: prompts drawn before the checkpoint but never trained on
            ids = dict(zip((int(i) for i in self.dataset.ids), self.dataset.prompt_ids))
            self.rollouts.requeue(self.rollouts.open(state.unfinished, [ids[i] for i in state.unfinished]))
        self.metrics.rewind(state.step)
        return state

    def save_checkpoint(self, name: str) -> str:
        """HF-format policy under checkpoints/<name>, renamed into place only once complete."""
        final = self.metrics.run_dir / "checkpoints" / name
        # publish_dir replaces an existing one: a resumed run writes its "final" again
        with self._learner_lock, publish_dir(final) as tmp:
            self.pools.learner.save_pretrained_policy(str(tmp))
        return str(final)

    # ------------------------------------------------------------------ new generators, recovery, evaluation
    def add_generator(self) -> str:
        """Start one more generator and give it the current weights before it serves."""
        (rid,) = self.pools.generators.add(1)
        self._give_current_weights(rid)
        return rid

    def _give_current_weights(self, replica_id: str) -> None:
        with self._learner_lock:
            if self.version:  # version 0 is the checkpoint every generator loads at start
                self.pools.learner.push_weights({replica_id: self.pools.generators.handles()[replica_id]},
                                                self.version)

    def evaluate(self) -> dict:
        """Mean score and response length on the held-out prompts, with the current weights."""
        return evaluation.evaluate(self.eval_dataset, self.pools, gold=self.cfg.reward.gold)

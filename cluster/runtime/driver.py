"""The PPO loop: prompts -> rollouts -> scores -> buffer -> learner -> weights -> generators.

One step, as `step()` reads:
    rollouts  sync: generate, score and store this step's prompts (async: a producer thread does it)
    batch     take the learner's shards from the buffer, by reference, plus a summary for metrics
    learn     the PPO epochs on the learner group
    sync      update the KL controller from the batch, push the new weights, bump the version

Sync mode is on-policy: each step's rollouts come from the current version and the
next generation waits for the weight push. Async mode keeps generating while the
learner trains; the buffer drops rollouts more than `buffer.max_staleness` versions old.
The driver holds object references and small summaries only; rollouts never pass through it.

Beside the loop, in their own modules: recovery (cluster/runtime/recovery.py; a dead
rollout-side replica or buffer is handled where the rollouts are made, cluster/runtime/rollouts.py),
scaling between steps (cluster/runtime/scaling.py) and evaluation (cluster/runtime/evaluation.py).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from pathlib import Path

import numpy as np
import ray
from ray.exceptions import RayActorError

from cluster.config.ppo import TetherConfig
from cluster.runtime import checkpoint, evaluation, recovery, scaling
from cluster.runtime.admission import Admission
from cluster.runtime.alarms import OveroptimizationAlarm
from cluster.runtime.background import BackgroundProducer
from cluster.runtime.checkpoint import RunState
from cluster.runtime.metrics import RayMetrics, RunMetrics, progress_line
from cluster.runtime.pools import Pools, alive
from cluster.runtime.produced import Produced, kept_set_warning, transfer_metrics
from cluster.runtime.reward_check import check_invalid_scores
from cluster.runtime.rollouts import RolloutProducer
from cluster.runtime.threads import chunks_per_generator
from core.annotate import RewardShaping
from core.files import publish_dir
from core.kl import AdaptiveKLController, FixedKLController
from core.transfer import Transfer
from core.weights import WEIGHT_UPDATE_GROUP
from learner.group import LearnerRankDied
from learner.worker import TO_LEARNER

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
        self.control = control  # a RunControl actor (cluster/runtime/control.py), or None
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
        # Drawing a batch and opening its ledger chunks is one act, so a checkpoint's data
        # position and its unfinished prompts agree (async mode draws in another thread).
        self._issue_lock = threading.Lock()
        self._seek(0)
        self.rollouts = RolloutProducer(pools, put_timeout_s=cfg.buffer.timeout_s,
                                        chunks_per_generator=chunks_per_generator(cfg),
                                        on_new_generator=self._give_current_weights,
                                        filter_groups=cfg.ppo.filter_groups)
        self.admission = Admission(per_step=cfg.rollouts_per_step,
                                   max_staleness=cfg.buffer.max_staleness, outstanding=self._outstanding_rollouts)
        self.stop_requested = threading.Event()  # set by SIGTERM/SIGINT: stop at the next step boundary
        self.producer_stop_timeout_s = 60.0      # async mode: how long a stop waits for the producer thread
        self.rollbacks: list[dict] = []          # one record per learner recovery
        self.startup_metrics: dict = {}          # perf/startup_* of the process that built the pools (step 0)

    def shaping(self) -> RewardShaping:
        """How this step's rollouts get their per-token rewards (beta as the controller has it now)."""
        p = self.cfg.ppo
        return RewardShaping.for_step(beta=self.kl_ctl.value, kl_estimator=p.kl.estimator,
                                      kl_placement=p.kl.placement, truncation_penalty=p.truncation_penalty,
                                      reward_clip=p.reward_clip)

    def _kl_loss_coef(self) -> float:
        """beta for the learner's KL loss term (ppo.kl.placement=loss), else 0."""
        return self.kl_ctl.value if self.cfg.ppo.kl.placement == "loss" else 0.0

    # ------------------------------------------------------------------ the data stream
    def _seek(self, batches_issued: int) -> None:
        """Position the prompt stream after ``batches_issued`` batches (it is deterministic)."""
        stream = self.dataset.batches(self.cfg.data.prompts_per_step, epochs=None)
        self._prompts = itertools.islice(stream, batches_issued, None)
        self.batches_issued = batches_issued

    def issue(self) -> list:
        """The next batch of prompts, as ledger chunks."""
        with self._issue_lock:
            indices, prompt_ids, _ = next(self._prompts)
            self.batches_issued += 1
            return self.rollouts.open(indices, prompt_ids)

    def _outstanding_rollouts(self) -> int:
        """Rollouts issued and neither trained nor lost: in the buffer, or on their way there."""
        ledger = self.rollouts.ledger
        return ledger.held_rollouts() + self.cfg.generator.sampling.n * sum(
            len(c.prompt_indices) for c in ledger.in_flight())

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict:
        cfg, final = self.cfg, {}
        if self.step_count == 0:
            eval_metrics = self.evaluate() if cfg.run.eval_every else {}
            self.metrics.log(0, {**self.startup_metrics, **eval_metrics})
            log.info("step 0: eval %s", " ".join(f"{k}={v:.3f}" for k, v in eval_metrics.items()))
        producer = self._start_producer()
        t_start = time.perf_counter()
        try:
            while self.step_count < cfg.run.steps and not self.stop_requested.is_set():
                scaling.apply_requested(self.control, self.pools, on_new_generator=self._give_current_weights)
                try:
                    metrics = self.step(producer)
                    self._after_step(metrics)
                except LearnerRankDied as e:
                    producer = self._rollback(producer, e)
                    continue
                log.info(progress_line(self.step_count, cfg.run.steps, metrics, time.perf_counter() - t_start))
                final = metrics
        finally:
            self._stop_producer(producer, at_end=True)
        return final

    def step(self, producer) -> dict:
        """One PPO step; ``producer``: async mode's BackgroundProducer, None in sync mode."""
        timer = PhaseTimer()
        with timer("step"):
            # prompts -> rollouts -> scores -> buffer: sync mode now, async mode all along (the producer)
            produced = self._produce_now() if producer is None else None
            with timer("buffer_wait"):  # buffer -> the learner's shards
                shards, batch, regenerated = self._take(producer, self._min_version(producer))
            produced = (producer.take() if producer is not None else produced).merge(regenerated)
            check_invalid_scores(produced, self.cfg.reward, self.step_count + 1)  # async: what fed this step
            if warning := kept_set_warning(produced):  # one line per step, and only when it happens
                log.warning(warning)
            with timer("learn"), self._learner_lock:  # learner
                learn = self.pools.learner.train(shards, ptx_rows=self.ptx_rows(), kl_coef=self._kl_loss_coef())
            with timer("sync"), self._learner_lock:  # weights -> generators
                sync = self._publish(batch)
        return self._step_metrics(batch, produced, learn, sync, timer.seconds)

    def _produce_now(self) -> Produced:
        """Sync mode: this step's prompts generated, scored and stored, by the current version.
        With dynamic sampling (ppo.filter_groups) the buffer leaves out prompts whose samples
        all scored alike, and further prompt batches are drawn, up to ppo.filter_max_batches
        in all, until the step holds a full batch of rollouts; the step trains on one batch of
        whole groups, the first in prompt order, and leaves out the rest (``_take``)."""
        cfg = self.cfg
        produced = self.rollouts.produce(self.issue(), self.shaping())
        check_invalid_scores(produced, cfg.reward, self.step_count + 1)
        batches = 1
        while (cfg.ppo.filter_groups and batches < cfg.ppo.filter_max_batches
               and self.rollouts.ledger.held_rollouts() < cfg.rollouts_per_step):
            more = self.rollouts.produce(self.issue(), self.shaping())
            check_invalid_scores(more, cfg.reward, self.step_count + 1)
            more.extra_rollouts = more.prompts * cfg.generator.sampling.n
            produced, batches = produced.merge(more), batches + 1
        return produced

    def _min_version(self, producer) -> int:
        """The oldest policy version this step may train on: sync mode is on-policy."""
        return self.version if producer is None else max(0, self.version - self.cfg.buffer.max_staleness)

    def _take(self, producer, min_version: int):
        """The learner's shards and their summary from the buffer. A buffer that died is
        replaced and what it held generated again (sync: here; async: by the producer)."""
        cfg, world, regenerated = self.cfg, self.pools.learner.world_size, Produced()
        while True:
            # Here, in the thread that applies `consumed`, a dead buffer's prompts are queued
            # again (sync: and generated now; async: by the producer).
            if self.rollouts.recover_lost_buffer() and producer is None:
                regenerated = regenerated.merge(self.rollouts.produce([], self.shaping()))
            full = cfg.rollouts_per_step
            held = self.rollouts.ledger.held_rollouts() if producer is None else full
            # Sync: all that was made for this step; after a refill, one batch of it (DAPO).
            n, trim = (min(held, full), held > full) if cfg.ppo.filter_groups else (held, False)
            if n == 0:
                raise RuntimeError(f"version {self.version}: no usable rollouts (all prompts skipped or all "
                                   "scores invalid); check data.max_prompt_tokens and the reward")
            slot = self.pools.buffer_slot
            buffer_id, buffer = slot.id, slot.handle
            try:
                *shards, summary_ref = buffer.take.options(num_returns=world + 1).remote(
                    n, world_size=world, min_version=min_version, current_version=self.version,
                    timeout=cfg.buffer.timeout_s, drop_surplus=trim)
                batch = ray.get(summary_ref)
            except RayActorError:
                if alive(buffer):
                    raise
                self.rollouts.buffer_died(buffer_id)
                continue
            self.rollouts.ledger.consumed(batch.consumed)
            self.admission.took()
            return shards, batch, regenerated

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
        self.admission.published()
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
        moved = transfer_metrics(produced, Transfer.pop_metrics(learn, TO_LEARNER))  # learn keeps the rest
        m = {"reward/mean": batch.scores.mean(), "reward/std": batch.scores.std(),
             "kl/mean": batch.kl_sums.mean(), "kl/beta": self.kl_ctl.value,
             "response/length_mean": batch.response_lengths.mean(),
             "response/truncated_frac": float(batch.truncated.mean()),
             "rollouts/used": len(batch.scores), "rollouts/prompts": produced.prompts,
             "rollouts/skipped_prompts": produced.skipped_prompts,
             "rollouts/invalid_scores": produced.invalid_scores,
             "reward/timeouts": produced.reward_counts.get("timeouts", 0),
             "reward/crashes": produced.reward_counts.get("crashes", 0),
             "rollouts/empty_responses": produced.empty_responses,
             "rollouts/incomplete_kept_sets": produced.incomplete_kept_sets,
             "rollouts/duplicate_chunks": produced.duplicate_chunks,
             "rollouts/redispatched_chunks": produced.redispatched_chunks,
             **self._filter_metrics(produced, batch),
             "policy/version": self.version, "data/batches_issued": self.batches_issued,
             **{f"pool/{role}_replicas": n for role, n in self.pools.sizes().items()},
             "buffer/depth": batch.buffer_depth,
             "buffer/dropped_stale": batch.dropped_stale,
             "buffer/staleness_mean": float(batch.staleness.mean()),
             "buffer/staleness_max": int(batch.staleness.max()),
             "buffer/token_staleness_mean": float(batch.token_staleness.mean()),
             "rollouts/partial_frac": float(batch.partial.mean()),
             "perf/step_seconds": seconds["step"], "perf/generate_seconds": produced.generate_seconds,
             "perf/score_seconds": produced.score_seconds,
             "perf/buffer_wait_seconds": seconds["buffer_wait"], "perf/learn_seconds": seconds["learn"],
             "perf/admission_wait_seconds": self.admission.pop_waited_seconds(),
             "perf/sync_seconds": sync.get("seconds", seconds["sync"]), "perf/sync_bytes": sync.get("bytes", 0),
             "perf/sync_wait_seconds": sync.get("wait_seconds", 0.0),
             "perf/tokens_per_s": produced.tokens / max(produced.generate_seconds, 1e-9), **moved, **learn,
             **evaluation.source_metrics(batch, self.dataset.columns, self.cfg.data.source_field),
             **{f"reward/{k}": v for k, v in produced.reward_counts.items()}}
        for g, tps in produced.per_generator_tps.items():
            self.ray_metrics.record({"generator/tokens_per_s": tps}, {"pool": "generator", "replica": g})
        for pool, lat in produced.score_latency.items():
            self.ray_metrics.record({"score/seconds": float(np.mean(lat))}, {"pool": pool})
        if self.cfg.run.samples_every and self.version % self.cfg.run.samples_every == 0:
            self.metrics.samples(self.version, [evaluation.decode_sample(self.tokenizer, row, self.dataset.columns)
                                                for row in batch.samples])
        return m

    def _filter_metrics(self, produced: Produced, batch) -> dict:
        """Dynamic sampling's share left out and what refilling the step cost (ppo.filter_groups)."""
        if not self.cfg.ppo.filter_groups:
            return {}
        sampled = max(produced.prompts - produced.skipped_prompts, 1)
        return {"rollouts/filtered_frac": produced.filtered_prompts / sampled,
                "rollouts/extra_generated": produced.extra_rollouts, "rollouts/surplus": batch.surplus}

    # ------------------------------------------------------------------ checkpoints
    def run_state(self) -> RunState:
        with self._issue_lock:
            return RunState(step=self.step_count, version=self.version, batches_issued=self.batches_issued,
                            unfinished=tuple(self.rollouts.ledger.unfinished_prompts()),
                            kl_beta=self.kl_ctl.value, pinned=checkpoint.pinned_values(self.cfg),
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
        self.admission.published()  # nothing taken at the restored version yet
        self._seek(state.batches_issued)
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

    def _rollback(self, producer, error: LearnerRankDied):
        """A learner rank died: new ranks, the last checkpoint, and the run goes on from there."""
        detected_at = time.perf_counter()  # the death was just reported: this is when it was detected
        log.warning("%s; rebuilding the learner and rolling back to the last checkpoint", error)
        self._stop_producer(producer)
        self.rollbacks.append(recovery.roll_back(
            error, pools=self.pools, rollouts=self.rollouts, learner_lock=self._learner_lock,
            run_dir=self.metrics.run_dir, restore=self.restore, failed_at=self.step_count, detected_at=detected_at,
            placement_timeout_s=self.cfg.resources.placement_timeout_s))
        return self._start_producer()

    def _start_producer(self):
        if self.cfg.run.mode != "async":
            return None
        return BackgroundProducer(self.rollouts, admit=self.admission.wait, issue=self.issue, shaping=self.shaping)

    def _stop_producer(self, producer, *, at_end: bool = False) -> None:
        recovery.stop_producer(producer, timeout_s=self.producer_stop_timeout_s, run_dir=self.metrics.run_dir,
                               at_end=at_end)

    def evaluate(self) -> dict:
        """Mean score and response length on the held-out prompts, with the current weights."""
        return evaluation.evaluate(self.eval_dataset, self.pools, gold=self.cfg.reward.gold)

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
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time

import numpy as np
import ray

from cluster.config import TetherConfig
from cluster.metrics import RayMetrics, RunMetrics, progress_line
from cluster.pools import Pools
from cluster.rollouts import Produced, RolloutProducer
from core.annotate import RewardShaping
from core.ppo import AdaptiveKLController, FixedKLController

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
                 metrics: RunMetrics, ptx_batches=None) -> None:
        self.cfg, self.pools, self.tokenizer, self.metrics = cfg, pools, tokenizer, metrics
        self.eval_dataset, self.ptx_batches = eval_dataset, ptx_batches
        kl = cfg.ppo.kl
        self.kl_ctl = (AdaptiveKLController(kl.beta, kl.target, kl.horizon) if kl.target
                       else FixedKLController(kl.beta))
        self.ray_metrics = RayMetrics()
        self.version = 0
        # Learner calls are collectives: two threads (async mode's producer replacing a dead
        # generator, the main loop training) must not interleave them differently per rank.
        self._learner_lock = threading.Lock()
        self.prompts = dataset.batches(cfg.data.prompts_per_step, epochs=None)
        self.rollouts = RolloutProducer(pools, put_timeout_s=cfg.buffer.timeout_s,
                                        on_new_generator=self._give_current_weights)

    def shaping(self) -> RewardShaping:
        """How this step's rollouts get their per-token rewards (beta as the controller has it now)."""
        p = self.cfg.ppo
        return RewardShaping(beta=self.kl_ctl.value, kl_estimator=p.kl.estimator,
                             truncation_penalty=p.truncation_penalty, reward_clip=p.reward_clip)

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict:
        cfg, final = self.cfg, {}
        eval_metrics = self.evaluate() if cfg.run.eval_every else {}
        self.metrics.log(0, eval_metrics)
        log.info("step 0: eval %s", " ".join(f"{k}={v:.3f}" for k, v in eval_metrics.items()))
        producer = _Producer(self) if cfg.run.mode == "async" else None
        t_start = time.perf_counter()
        try:
            for step in range(1, cfg.run.steps + 1):
                metrics = self.step(producer)
                if cfg.run.eval_every and (step % cfg.run.eval_every == 0 or step == cfg.run.steps):
                    metrics.update(self.evaluate())
                if cfg.run.save_every and step % cfg.run.save_every == 0:
                    self.save_checkpoint(f"step-{step}")
                self.metrics.log(step, metrics)  # also records the Ray gauges
                log.info(progress_line(step, cfg.run.steps, metrics, time.perf_counter() - t_start))
                final = metrics
        finally:
            if producer:
                producer.stop()
        return final

    def step(self, producer) -> dict:
        cfg, learner, timer = self.cfg, self.pools.learner, PhaseTimer()
        with timer("step"):
            if producer is None:  # sync: this step's rollouts, from the current version
                indices, prompt_ids, _ = next(self.prompts)
                produced = self.rollouts.produce(indices, prompt_ids, self.shaping())
                n, min_version = produced.stored, self.version
            else:
                n = cfg.data.prompts_per_step * cfg.generator.sampling.n
                min_version = max(0, self.version - cfg.buffer.max_staleness)
            if n == 0:
                raise RuntimeError(f"version {self.version}: no usable rollouts (all prompts skipped or all "
                                   "scores invalid); check data.max_prompt_tokens and the reward")
            with timer("buffer_wait"):
                *shards, summary_ref = self.pools.buffer.take.options(num_returns=learner.world_size + 1).remote(
                    n, world_size=learner.world_size, min_version=min_version,
                    current_version=self.version, timeout=cfg.buffer.timeout_s)
                batch = ray.get(summary_ref)
            if producer is not None:
                produced = producer.take()  # the generation work that fed this step
            ptx = next(self.ptx_batches) if self.ptx_batches is not None else None
            with timer("learn"), self._learner_lock:
                learn = learner.train(shards, ptx_batch=ptx)
            with timer("sync"), self._learner_lock:
                self.kl_ctl.update(float(batch.kl_sums.mean()), n_steps=len(batch.scores))
                sync = learner.push_weights(self.pools.generators.handles(), self.version + 1)
                self.version += 1
        return self._step_metrics(batch, produced, learn, sync, timer.seconds)

    def _step_metrics(self, batch, produced: Produced, learn: dict, sync: dict, seconds: dict) -> dict:
        stats = ray.get(self.pools.buffer.stats.remote())
        m = {"reward/mean": batch.scores.mean(), "reward/std": batch.scores.std(),
             "kl/mean": batch.kl_sums.mean(), "kl/beta": self.kl_ctl.value,
             "response/length_mean": batch.response_lengths.mean(),
             "response/truncated_frac": float(batch.truncated.mean()),
             "rollouts/used": len(batch.scores), "rollouts/prompts": produced.prompts,
             "rollouts/skipped_prompts": produced.skipped_prompts,
             "rollouts/invalid_scores": produced.invalid_scores,
             "rollouts/empty_responses": produced.empty_responses,
             "rollouts/duplicate_chunks": produced.duplicate_chunks,
             "rollouts/redispatched_chunks": produced.redispatched_chunks,
             "learner/dropped_rollouts": batch.dropped,
             "policy/version": self.version, "buffer/depth": stats["depth"],
             "buffer/dropped_stale": stats["dropped_stale"],
             "buffer/staleness_mean": float(batch.staleness.mean()),
             "buffer/staleness_max": int(batch.staleness.max()),
             "perf/step_seconds": seconds["step"], "perf/generate_seconds": produced.generate_seconds,
             "perf/score_seconds": produced.score_seconds,
             "perf/buffer_wait_seconds": seconds["buffer_wait"], "perf/learn_seconds": seconds["learn"],
             "perf/sync_seconds": sync.get("seconds", seconds["sync"]), "perf/sync_bytes": sync.get("bytes", 0),
             "perf/tokens_per_s": produced.tokens / max(produced.generate_seconds, 1e-9), **learn}
        for g, tps in produced.per_generator_tps.items():
            self.ray_metrics.record({"generator/tokens_per_s": tps}, {"pool": "generator", "replica": g})
        for pool, lat in produced.score_latency.items():
            self.ray_metrics.record({"score/seconds": float(np.mean(lat))}, {"pool": pool})
        if self.cfg.run.samples_every and self.version % self.cfg.run.samples_every == 0:
            self.metrics.samples(self.version, [self._decode(row) for row in batch.samples])
        return m

    def _decode(self, row: dict) -> dict:
        dec = self.tokenizer.decode
        return {"prompt": dec(row["prompt_ids"], skip_special_tokens=True),
                "response": dec(row["response_ids"], skip_special_tokens=True),
                **{k: row[k] for k in ("score", "kl_sum", "finish_reason", "policy_version")}}

    # ------------------------------------------------------------------ runtime scaling
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

    # ------------------------------------------------------------------ checkpoints and eval
    def save_checkpoint(self, name: str) -> str:
        """HF-format policy under checkpoints/<name>, renamed into place only once complete."""
        final = self.metrics.run_dir / "checkpoints" / name
        tmp = final.with_name(f".{name}.partial")
        self.pools.learner.save_pretrained_policy(str(tmp))
        tmp.rename(final)
        return str(final)

    def evaluate(self) -> dict:
        """Mean score and response length on the held-out prompts, with the current weights."""
        if self.eval_dataset is None or len(self.eval_dataset) == 0:
            return {}
        generator, reward = self.pools.generators.first(), self.pools.rewards.first()
        rollouts_ref, summary_ref = generator.sample.options(num_returns=2).remote(
            self.eval_dataset.prompt_ids, list(self.eval_dataset.ids))
        summary = ray.get(summary_ref)
        if not summary.rollouts:
            return {}
        scores = ray.get(reward.score_rollouts.remote(rollouts_ref))
        valid = scores.scores[scores.valid]
        return {"eval/score_mean": float(valid.mean()) if len(valid) else float("nan"),
                "eval/response_len": summary.generated_tokens / summary.rollouts}


class _Producer:
    """Async mode: keeps generating and scoring with whatever weights the generators hold.

    take() returns the accounting of everything produced since the previous take(), so
    each step reports the generation work done during it.
    """

    def __init__(self, driver: Driver) -> None:
        self._driver, self._stop = driver, threading.Event()
        self._pending, self._lock, self._error = Produced(), threading.Lock(), None
        self._thread = threading.Thread(target=self._loop, name="tether-producer", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        d = self._driver
        try:
            while not self._stop.is_set():
                indices, prompt_ids, _ = next(d.prompts)
                produced = d.rollouts.produce(indices, prompt_ids, d.shaping())
                with self._lock:
                    self._pending = self._pending.merge(produced)
        except Exception as e:  # noqa: BLE001 - surfaced by take() in the main thread
            self._error = e

    def take(self) -> Produced:
        if self._error is not None:
            raise self._error
        with self._lock:
            out, self._pending = self._pending, Produced()
        return out

    def stop(self) -> None:
        self._stop.set()

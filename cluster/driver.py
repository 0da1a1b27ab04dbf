"""The PPO loop: prompts -> rollouts -> scores -> buffer -> learner -> weights -> generators.

Sync mode is on-policy: each step's rollouts come from the current version and the
next generation waits for the weight push. Async mode keeps a producer thread
generating while the learner trains; the buffer drops rollouts more than
`buffer.max_staleness` versions old.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import ray

from core.annotate import annotate
from cluster.config import TetherConfig
from cluster.metrics import RayMetrics, RunMetrics, progress_line
from cluster.pools import Pools
from core.ppo import AdaptiveKLController, FixedKLController

log = logging.getLogger("tether")


@dataclass
class Produced:
    """One batch of prompts turned into scored rollouts, with what was lost on the way."""
    scored: list = field(default_factory=list)
    prompts: int = 0
    skipped_prompts: int = 0      # too long for the model
    invalid_scores: int = 0       # reward returned NaN/inf or raised
    empty_responses: int = 0
    generate_seconds: float = 0.0
    score_seconds: float = 0.0    # scoring time not hidden behind generation
    tokens: int = 0
    per_generator_tps: dict = field(default_factory=dict)
    score_latency: dict = field(default_factory=dict)  # pool -> seconds of each scoring call


class Driver:
    def __init__(self, cfg: TetherConfig, *, pools: Pools, dataset, eval_dataset, tokenizer,
                 metrics: RunMetrics, ptx_batches=None) -> None:
        self.cfg, self.pools, self.tokenizer, self.metrics = cfg, pools, tokenizer, metrics
        self.dataset, self.eval_dataset, self.ptx_batches = dataset, eval_dataset, ptx_batches
        kl = cfg.ppo.kl
        self.kl_ctl = (AdaptiveKLController(kl.beta, kl.target, kl.horizon) if kl.target
                       else FixedKLController(kl.beta))
        self.ray_metrics = RayMetrics()
        self.version = 0
        self._prompts = dataset.batches(cfg.data.prompts_per_step, epochs=None)
        self._rr = 0  # round-robin cursor over scorer replicas

    # ------------------------------------------------------------------ rollouts
    def produce(self, indices, prompt_ids) -> Produced:
        """Spread prompt chunks over generators (least-loaded first); score each chunk as soon
        as it is generated, so scoring overlaps the generation of the others."""
        gens, out = self.pools.generators, Produced(prompts=len(indices))
        n_chunks = min(len(indices), 2 * len(gens))
        load, pending = [0] * len(gens), {}
        t0 = time.perf_counter()
        for chunk in np.array_split(np.arange(len(indices)), n_chunks):
            g = int(np.argmin(load))
            load[g] += 1
            ref = gens[g].generate.remote([prompt_ids[i] for i in chunk], [int(indices[i]) for i in chunk])
            pending[ref] = g
        scoring, tps = [], {}
        while pending:
            [done], _ = ray.wait(list(pending), num_returns=1)
            g = pending.pop(done)
            load[g] -= 1
            result = ray.get(done)
            out.skipped_prompts += len(result.skipped_prompts)
            out.tokens += result.generated_tokens
            tps.setdefault(g, []).append(result.tokens_per_second)
            if result.rollouts:
                scoring.append(self._dispatch_scoring(result.rollouts))
        out.generate_seconds = time.perf_counter() - t0
        out.per_generator_tps = {g: float(np.mean(v)) for g, v in tps.items()}
        t1 = time.perf_counter()
        for rollouts, ref_future, reward_future, started in scoring:
            self._collect(out, rollouts, ref_future, reward_future, started)
        out.score_seconds = time.perf_counter() - t1
        return out

    def _dispatch_scoring(self, rollouts):
        refs, rewards = self.pools.references, self.pools.rewards
        prompts = [r.prompt_ids for r in rollouts]
        responses = [r.response_ids for r in rollouts]
        self._rr += 1
        return (rollouts, refs[self._rr % len(refs)].logprobs.remote(prompts, responses),
                rewards[self._rr % len(rewards)].score.remote(prompts, responses), time.perf_counter())

    def _collect(self, out: Produced, rollouts, ref_future, reward_future, started) -> None:
        ref_lp = ray.get(ref_future)
        out.score_latency.setdefault("reference", []).append(time.perf_counter() - started)
        result = ray.get(reward_future)
        out.score_latency.setdefault("reward", []).append(time.perf_counter() - started)
        for err in result.errors:
            log.warning("reward: %s", err)
        keep = np.flatnonzero(result.valid)
        out.invalid_scores += len(rollouts) - len(keep)
        kept = [rollouts[i] for i in keep]
        p = self.cfg.ppo
        scored = annotate(kept, [ref_lp[i] for i in keep], result.scores[keep],
                          beta=self.kl_ctl.value, kl_estimator=p.kl.estimator,
                          truncation_penalty=p.truncation_penalty, reward_clip=p.reward_clip)
        out.empty_responses += len(kept) - len(scored)
        out.scored.extend(scored)

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict:
        cfg = self.cfg
        final = {}
        eval_metrics = self.evaluate() if cfg.run.eval_every else {}
        self.metrics.log(0, eval_metrics)
        log.info("step 0: eval %s", _fmt(eval_metrics))
        producer = _Producer(self) if cfg.run.mode == "async" else None
        t_start = time.perf_counter()
        try:
            for step in range(1, cfg.run.steps + 1):
                metrics = self.step(step, producer)
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

    def step(self, step: int, producer) -> dict:
        cfg, buffer = self.cfg, self.pools.buffer
        t0 = time.perf_counter()
        if producer is None:
            indices, prompt_ids, _ = next(self._prompts)
            produced = self.produce(indices, prompt_ids)
            ray.get(buffer.put.remote(produced.scored))
            n, min_version = len(produced.scored), self.version
        else:
            produced = None  # taken after the batch arrives: the work that fed this step
            n = cfg.data.prompts_per_step * cfg.generator.sampling.n
            min_version = max(0, self.version - cfg.buffer.max_staleness)
        if n == 0:
            raise RuntimeError(f"step {step}: no usable rollouts (all prompts skipped or all scores "
                               "invalid); check data.max_prompt_tokens and the reward")
        t_get = time.perf_counter()
        batch = ray.get(buffer.get.remote(n, min_version=min_version, current_version=self.version,
                                          timeout=600.0))
        wait_s = time.perf_counter() - t_get
        if producer is not None:
            produced = producer.take()
        ptx = next(self.ptx_batches) if self.ptx_batches is not None else None
        t1 = time.perf_counter()
        learn = self.pools.learner.train(batch, ptx_batch=ptx)
        t2 = time.perf_counter()
        sync = self.pools.learner.push_weights(self.pools.generators, self.version + 1)
        self.version += 1
        t3 = time.perf_counter()
        return self._step_metrics(batch, produced, learn, sync, buffer_wait=wait_s,
                                  times=(t0, t1, t2, t3))

    def _step_metrics(self, batch, produced: Produced, learn, sync, buffer_wait, times) -> dict:
        t0, t1, t2, t3 = times
        scores = np.array([r.score for r in batch], dtype=np.float64)
        seq_kl = np.array([float(np.sum(r.kl)) for r in batch])
        lengths = np.array([len(r.response_ids) for r in batch])
        staleness = np.array([self.version - 1 - r.policy_version for r in batch])
        self.kl_ctl.update(float(seq_kl.mean()), n_steps=len(batch))
        stats = ray.get(self.pools.buffer.stats.remote())
        m = {"reward/mean": scores.mean(), "reward/std": scores.std(),
             "kl/mean": seq_kl.mean(), "kl/beta": self.kl_ctl.value,
             "response/length_mean": lengths.mean(),
             "response/truncated_frac": float(np.mean([r.truncated for r in batch])),
             "rollouts/used": len(batch), "rollouts/prompts": produced.prompts,
             "rollouts/skipped_prompts": produced.skipped_prompts,
             "rollouts/invalid_scores": produced.invalid_scores,
             "rollouts/empty_responses": produced.empty_responses,
             "policy/version": self.version, "buffer/depth": stats.get("depth", 0),
             "buffer/dropped_stale": stats.get("dropped_stale", 0),
             "buffer/staleness_mean": float(staleness.mean()), "buffer/staleness_max": int(staleness.max()),
             "perf/step_seconds": t3 - t0, "perf/generate_seconds": produced.generate_seconds,
             "perf/score_seconds": produced.score_seconds, "perf/buffer_wait_seconds": buffer_wait,
             "perf/learn_seconds": t2 - t1, "perf/sync_seconds": sync.get("seconds", t3 - t2),
             "perf/sync_bytes": sync.get("bytes", 0),
             "perf/tokens_per_s": produced.tokens / max(produced.generate_seconds, 1e-9)}
        for g, tps in produced.per_generator_tps.items():
            self.ray_metrics.record({"generator/tokens_per_s": tps}, {"pool": "generator", "replica": str(g)})
        for pool, lat in produced.score_latency.items():
            self.ray_metrics.record({"score/seconds": float(np.mean(lat))}, {"pool": pool})
        m.update(learn)
        if self.cfg.run.samples_every and self.version % self.cfg.run.samples_every == 0:
            firsts = [r for r in batch if r.sample_index == 0]  # one sample each of distinct prompts
            self.metrics.samples(self.version, self._sample_rows(firsts[:4]))
        return m

    def _sample_rows(self, rollouts) -> list[dict]:
        dec = self.tokenizer.decode
        return [{"prompt": dec(r.prompt_ids, skip_special_tokens=True),
                 "response": dec(r.response_ids, skip_special_tokens=True),
                 "score": float(r.score), "kl_sum": float(np.sum(r.kl)),
                 "finish_reason": r.finish_reason, "policy_version": r.policy_version}
                for r in rollouts]

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
        indices, prompt_ids = self.eval_dataset.ids, self.eval_dataset.prompt_ids
        result = ray.get(self.pools.generators[0].generate.remote(prompt_ids, list(indices)))
        rollouts = result.rollouts
        if not rollouts:
            return {}
        scores = ray.get(self.pools.rewards[0].score.remote(
            [r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts]))
        valid = scores.scores[scores.valid]
        return {"eval/score_mean": float(valid.mean()) if len(valid) else float("nan"),
                "eval/response_len": float(np.mean([len(r.response_ids) for r in rollouts]))}


class _Producer:
    """Async mode: keeps generating and scoring with whatever weights the generators hold.

    take() returns the accounting (prompts, skips, tokens, seconds) of everything produced
    since the previous take(), so each step reports the generation work done during it.
    """

    def __init__(self, driver: Driver) -> None:
        self.driver, self._stop = driver, threading.Event()
        self._pending, self._lock, self._error = Produced(), threading.Lock(), None
        self._thread = threading.Thread(target=self._loop, name="tether-producer", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        d = self.driver
        try:
            while not self._stop.is_set():
                indices, prompt_ids, _ = next(d._prompts)
                produced = d.produce(indices, prompt_ids)
                ray.get(d.pools.buffer.put.remote(produced.scored, timeout=600.0))
                produced.scored = []  # the rollouts live in the buffer now
                with self._lock:
                    self._pending = _merge(self._pending, produced)
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


def _merge(a: Produced, b: Produced) -> Produced:
    latency = {k: a.score_latency.get(k, []) + b.score_latency.get(k, [])
               for k in set(a.score_latency) | set(b.score_latency)}
    return Produced(scored=[], prompts=a.prompts + b.prompts,
                    skipped_prompts=a.skipped_prompts + b.skipped_prompts,
                    invalid_scores=a.invalid_scores + b.invalid_scores,
                    empty_responses=a.empty_responses + b.empty_responses,
                    generate_seconds=a.generate_seconds + b.generate_seconds,
                    score_seconds=a.score_seconds + b.score_seconds, tokens=a.tokens + b.tokens,
                    per_generator_tps={**a.per_generator_tps, **b.per_generator_tps},
                    score_latency=latency)


def _fmt(m: dict) -> str:
    return " ".join(f"{k}={v:.3f}" for k, v in m.items() if isinstance(v, float))

"""Turning a batch of prompts into scored rollouts in the buffer, by reference.

The driver holds object references and small summaries only:

    generator.sample(chunk)          -> (rollouts_ref, GenerationSummary)   num_returns=2
    reference.reference_logprobs(rollouts_ref)                  -> ref_lp_ref
    reward.score_rollouts(rollouts_ref)                         -> score_ref
    buffer.put_chunk(id, rollouts_ref, ref_lp_ref, score_ref)   -> ChunkReport

Ray resolves each reference inside the actor that takes it, so a rollout goes from
the generator to the scorers and the buffer, never through this process. Each chunk
is dispatched to the least-loaded replica of each pool and tracked in the ledger.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from cluster.ledger import Ledger

log = logging.getLogger("tether")


@dataclass
class Produced:
    """One batch of prompts turned into scored rollouts in the buffer, with what was lost on the way."""
    stored: int = 0               # scored rollouts put into the buffer
    prompts: int = 0
    skipped_prompts: int = 0      # too long for the model
    invalid_scores: int = 0       # reward returned NaN/inf or raised
    empty_responses: int = 0
    duplicate_chunks: int = 0     # chunks the buffer had already stored (exactly-once at work)
    redispatched_chunks: int = 0  # chunks sent again because the replica holding them died
    generate_seconds: float = 0.0
    score_seconds: float = 0.0    # scoring time not hidden behind generation
    tokens: int = 0
    per_generator_tps: dict = field(default_factory=dict)  # replica id -> tokens/s
    score_latency: dict = field(default_factory=dict)      # pool -> seconds of each scoring call

    def merge(self, other: "Produced") -> "Produced":
        """Accounting of two batches together (async mode sums what fed one step)."""
        latency = {k: self.score_latency.get(k, []) + other.score_latency.get(k, [])
                   for k in set(self.score_latency) | set(other.score_latency)}
        sums = {f: getattr(self, f) + getattr(other, f) for f in
                ("stored", "prompts", "skipped_prompts", "invalid_scores", "empty_responses",
                 "duplicate_chunks", "redispatched_chunks", "generate_seconds", "score_seconds", "tokens")}
        return Produced(**sums, per_generator_tps={**self.per_generator_tps, **other.per_generator_tps},
                        score_latency=latency)


class RolloutProducer:
    """Dispatches prompt chunks through the pools into the buffer (see module docstring).

    A replica that dies (its process killed, its node lost) is replaced in its pool and
    the chunks it held are redispatched; ``on_new_generator(replica_id)`` runs before a
    replacement generator serves (the driver gives it the current weights).
    """

    def __init__(self, pools, *, chunks_per_generator: int = 2, put_timeout_s: float,
                 health_timeout_s: float = 30.0, on_new_generator=None) -> None:
        self.pools, self.ledger = pools, Ledger()
        self.chunks_per_generator, self.put_timeout_s = chunks_per_generator, put_timeout_s
        self.health_timeout_s = health_timeout_s
        self.on_new_generator = on_new_generator or (lambda replica_id: None)

    def produce(self, indices, prompt_ids, shaping) -> Produced:
        """Generate, score and store one batch; returns once every chunk is stored."""
        out = Produced(prompts=len(indices))
        n_chunks = min(len(indices), self.chunks_per_generator * len(self.pools.generators))
        pending: dict = {}  # object ref -> _InFlight
        for rows in np.array_split(np.arange(len(indices)), n_chunks):
            chunk = self.ledger.open([int(indices[i]) for i in rows], [prompt_ids[i] for i in rows])
            pending.update(self._generate(chunk))
        t0 = time.perf_counter()
        t_generated, tps = None, {}
        while pending:
            # fetch_local=False: only completion is awaited; the data stays where it is.
            [done], _ = ray.wait(list(pending), num_returns=1, fetch_local=False)
            job = pending.pop(done)
            if job.stage == "generated":
                self.pools.generators.release(job.replica)
                try:
                    summary = ray.get(done)  # a GenerationSummary: counts only
                except RayActorError as e:
                    self._recover(job, e, pending, out)
                    continue
                out.skipped_prompts += len(summary.skipped_prompts)
                out.tokens += summary.generated_tokens
                tps.setdefault(job.replica, []).append(summary.tokens_per_second)
                pending.update(self._score(job.chunk_id, summary, job.rollouts_ref, shaping))
                if all(j.stage != "generated" for j in pending.values()):
                    t_generated = time.perf_counter()
            elif job.stage == "stored":
                try:
                    report = ray.get(done)  # a ChunkReport: counts only
                except RayError as e:  # a scorer died, so the put lost an argument
                    self._recover(job, e, pending, out)
                    continue
                self._record(out, report)
            else:  # a scorer finished (or failed: the put then says so): free its slot
                job.pool.release(job.replica)
                out.score_latency.setdefault(job.stage, []).append(time.perf_counter() - job.started)
        t_end = time.perf_counter()
        out.generate_seconds = (t_generated or t_end) - t0
        out.score_seconds = t_end - (t_generated or t_end)
        out.per_generator_tps = {g: float(np.mean(v)) for g, v in tps.items()}
        self.ledger.forget_stored()
        return out

    # ------------------------------------------------------------------ replicas that died
    def _recover(self, job, error: Exception, pending: dict, out: Produced) -> None:
        """Replace every dead replica the failed call involved; redispatch what they held."""
        chunk = self.ledger.get(job.chunk_id)
        suspects = [(self._pool(role), rid) for role, rid in chunk.replicas.items()]
        dead = [(pool, rid) for pool, rid in suspects if not self._alive(pool, rid)]
        if not dead:
            raise error  # no replica died: a genuine failure of the call
        for pool, rid in dead:
            log.warning("%s died (%s); replacing it and redispatching its chunks", rid,
                        type(error).__name__)
            released = self.ledger.release(rid)
            pool.remove(rid)
            if len(pool) == 0:  # the pool's last replica: nothing can run until one is back
                self._add_replacement(pool)
                replaced = True
            else:
                replaced = False
            for c in released:  # to the live replicas at once, while a replacement starts
                self._forget(c.id, pending)
                pending.update(self._generate(c))
                out.redispatched_chunks += 1
            if not replaced:
                self._add_replacement(pool)

    def _add_replacement(self, pool) -> None:
        (new_id,) = pool.add(1)
        if pool is self.pools.generators:
            self.on_new_generator(new_id)

    def _forget(self, chunk_id: int, pending: dict) -> None:
        """Drop a released chunk's outstanding calls, freeing the live replicas' slots."""
        for ref, job in list(pending.items()):
            if job.chunk_id == chunk_id:
                del pending[ref]
                if job.pool is not None:
                    job.pool.release(job.replica)

    def _pool(self, role: str):
        return {"generator": self.pools.generators, "reference": self.pools.references,
                "reward": self.pools.rewards}[role]

    def _alive(self, pool, replica_id: str) -> bool:
        handle = pool.handles().get(replica_id)
        if handle is None:
            return False
        try:
            ray.get(handle.health.remote(), timeout=self.health_timeout_s)
            return True
        except (RayActorError, GetTimeoutError):
            return False

    def _generate(self, chunk) -> dict:
        replica = self.pools.generators.acquire()
        self.ledger.generating(chunk.id, replica.id)
        rollouts_ref, summary_ref = replica.handle.sample.options(num_returns=2).remote(
            chunk.prompt_ids, chunk.prompt_indices)
        return {summary_ref: _InFlight("generated", chunk.id, replica.id, rollouts_ref=rollouts_ref)}

    def _score(self, chunk_id: int, summary, rollouts_ref, shaping) -> dict:
        if summary.rollouts == 0:  # every prompt skipped: nothing to score or store
            self.ledger.stored(chunk_id)
            return {}
        refs, rewards = self.pools.references, self.pools.rewards
        ref, rew = refs.acquire(), rewards.acquire()
        self.ledger.scoring(chunk_id, ref.id, rew.id)
        ref_lp = ref.handle.reference_logprobs.remote(rollouts_ref)
        scores = rew.handle.score_rollouts.remote(rollouts_ref)
        put = self.pools.buffer.put_chunk.remote(chunk_id, rollouts_ref, ref_lp, scores, shaping,
                                                 timeout=self.put_timeout_s)
        return {ref_lp: _InFlight("reference", chunk_id, ref.id, pool=refs),
                scores: _InFlight("reward", chunk_id, rew.id, pool=rewards),
                put: _InFlight("stored", chunk_id, None)}

    def _record(self, out: Produced, report) -> None:
        for err in report.errors:
            log.warning("reward: %s", err)
        self.ledger.stored(report.chunk_id)  # in the buffer either way
        if report.duplicate:  # an earlier copy of this chunk was stored: count it once
            out.duplicate_chunks += 1
            return
        out.stored += report.stored
        out.invalid_scores += report.invalid_scores
        out.empty_responses += report.empty_responses


@dataclass
class _InFlight:
    """One remote call of a chunk's life that the producer waits on."""
    stage: str                    # "generated" | "reference" | "reward" | "stored"
    chunk_id: int
    replica: str | None
    pool: object = None           # the pool to release the replica to (scorers)
    rollouts_ref: object = None   # generation: the rollouts, left in the object store
    started: float = field(default_factory=time.perf_counter)

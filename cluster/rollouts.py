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
                 "duplicate_chunks", "generate_seconds", "score_seconds", "tokens")}
        return Produced(**sums, per_generator_tps={**self.per_generator_tps, **other.per_generator_tps},
                        score_latency=latency)


class RolloutProducer:
    """Dispatches prompt chunks through the pools into the buffer (see module docstring)."""

    def __init__(self, pools, *, chunks_per_generator: int = 2, put_timeout_s: float) -> None:
        self.pools, self.ledger = pools, Ledger()
        self.chunks_per_generator, self.put_timeout_s = chunks_per_generator, put_timeout_s

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
                summary = ray.get(done)  # a GenerationSummary: counts only
                out.skipped_prompts += len(summary.skipped_prompts)
                out.tokens += summary.generated_tokens
                tps.setdefault(job.replica, []).append(summary.tokens_per_second)
                pending.update(self._score(job.chunk_id, summary, job.rollouts_ref, shaping))
                if all(j.stage != "generated" for j in pending.values()):
                    t_generated = time.perf_counter()
            elif job.stage == "stored":
                self._record(out, ray.get(done))  # a ChunkReport: counts only
            else:  # a scorer finished: free its slot, note its latency
                job.pool.release(job.replica)
                out.score_latency.setdefault(job.stage, []).append(time.perf_counter() - job.started)
        t_end = time.perf_counter()
        out.generate_seconds = (t_generated or t_end) - t0
        out.score_seconds = t_end - (t_generated or t_end)
        out.per_generator_tps = {g: float(np.mean(v)) for g, v in tps.items()}
        self.ledger.forget_stored()
        return out

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

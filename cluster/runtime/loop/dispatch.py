"""Turning a batch of prompts into scored rollouts in the buffer, by reference.

The driver holds object references and small summaries only:

    generator.sample(chunk)                         -> (rollouts_ref, GenerationSummary)  num_returns=2
    reference.reference_logprobs_pulled(rollouts_ref)  -> (ref_lp_ref, Transfer)        num_returns=2
    reward.score_rollouts_pulled(rollouts_ref)         -> (score_ref, Transfer)         num_returns=2
    then, both done: buffer.put_chunk(id, rollouts_ref, ref_lp_ref, score_ref) -> ChunkReport

Each actor pulls the references it takes itself (passed in a core.infra.transfer.Pull), and says
what crossed nodes; so a rollout goes from the generator to the scorers and the buffer
and is never unpickled in this process. A put is sent once its chunk's scorers are done:
it waits in the buffer for the transfer only. Each chunk is dispatched to the least-loaded replica of
each pool and tracked in the ledger.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import ray
from ray.exceptions import RayActorError, RayError

from cluster.runtime.loop.ledger import ChunkState, Ledger
from cluster.runtime.observe.produced import Produced, add_counts
from cluster.runtime.pools.pool import alive
from core.infra.ray_calls import drain
from core.infra.transfer import Pull, lost_with_a_node

log = logging.getLogger("tether")

STOP_POLL_S = 0.5  # how often a stoppable produce() waiting on remote calls looks at its stop


class ChunkDispatcher:
    """Dispatches prompt chunks through the pools into the buffer (see module docstring).

    A replica that dies (its process killed, its node lost) is replaced in its pool and
    the chunks it held are redispatched; ``on_new_generator(replica_id)`` runs before a
    replacement generator serves (the driver gives it the current weights). A buffer that
    dies is replaced by an empty one, and every prompt it held (the ledger knows which)
    is generated again: nothing is restored from a dead process.
    """

    def __init__(self, pools, *, chunks_per_generator: int = 2, put_timeout_s: float,
                 health_timeout_s: float = 30.0, on_new_generator=None, filter_groups: bool = False) -> None:
        self.pools, self.ledger = pools, Ledger()
        self.filter_groups = filter_groups  # dynamic sampling: the buffer leaves out flat prompts
        self.chunks_per_generator, self.put_timeout_s = chunks_per_generator, put_timeout_s
        self.health_timeout_s = health_timeout_s
        self.on_new_generator = on_new_generator or (lambda replica_id: None)
        self._backlog: list = []  # chunks to generate again (a dead buffer's), any thread adds
        self._backlog_lock = threading.Lock()
        self._store_lock = threading.Lock()  # a chunk is stored into the current buffer, or redone
        self._lost_buffer = None  # a dead buffer whose chunks are not queued again yet
        self._abandoned: list = []  # calls of redispatched chunks; their errors are collected, not logged
        # One record per dead replica: role, id, and perf_counter() times of detection and of
        # the replacement serving (a generator: with the current weights).
        self.recoveries: list[dict] = []

    def open(self, indices, prompt_ids) -> list:
        """One batch of prompts as ledger chunks, a few per generator (so they spread)."""
        if len(indices) == 0:
            return []
        n_chunks = min(len(indices), self.chunks_per_generator * len(self.pools.generators))
        return [self.ledger.open([int(indices[i]) for i in rows], [prompt_ids[i] for i in rows])
                for rows in np.array_split(np.arange(len(indices)), n_chunks)]

    def produce(self, chunks: list, shaping, stop: threading.Event | None = None) -> Produced:
        """Generate, score and store ``chunks`` (and any backlog); returns once all is stored,
        or soon after ``stop`` is set (async mode's producer thread). A stopped produce abandons what is
        in flight (the ledger still counts it unfinished) and takes nothing from the backlog."""
        out = Produced(prompts=sum(len(c.prompt_indices) for c in chunks))
        if stop is not None and stop.is_set():
            return out
        pending: dict = {}  # object ref -> _InFlight
        for chunk in chunks:
            pending.update(self._generate(chunk))
        self._dispatch_backlog(pending, out, stop)
        t0 = time.perf_counter()
        t_generated, tps = None, {}
        while pending:
            if stop is not None and stop.is_set():
                self._forget(None, pending)
                break
            done = self._next_done(pending, stop)
            if done is None:
                continue
            job = pending.pop(done)
            if job.stage == "generated":
                if not self._on_generated(job, done, pending, out, tps, shaping):
                    continue
                if all(j.stage != "generated" for j in pending.values()):
                    t_generated = time.perf_counter()
            elif job.stage == "stored":
                try:
                    report = ray.get(done)  # a ChunkReport: counts only
                except RayError as e:  # the buffer died, or an input was lost with its node
                    self._recover(job, e, pending, out)
                    continue
                if not self._record(out, report, job.replica):  # it went into a buffer that died since
                    self._forget(job.chunk_id, pending)
                    if self.ledger.get(job.chunk_id).state is ChunkState.PENDING:
                        pending.update(self._generate(self.ledger.get(job.chunk_id)))
                        out.redispatched_chunks += 1
            else:  # a scorer finished (or failed): the put goes once both scorers are done
                self._on_scored(job, done, pending, out)
            self._dispatch_backlog(pending, out, stop)
        t_end = time.perf_counter()
        out.generate_seconds = (t_generated or t_end) - t0
        out.score_seconds = t_end - (t_generated or t_end)
        out.per_generator_tps = {g: float(np.mean(v)) for g, v in tps.items()}
        self.ledger.forget_stored()
        # errors of abandoned calls are expected: fetch the finished ones so Ray does not log them
        self._abandoned = drain(self._abandoned, timeout_s=0, fetch_local=False)
        return out

    @staticmethod
    def _next_done(pending: dict, stop: threading.Event | None):
        """A finished call's ref; None after STOP_POLL_S with a stop to look at, so that a stop
        never waits for a generation to end."""
        # fetch_local=False: only completion is awaited; the data stays where it is.
        ready, _ = ray.wait(list(pending), num_returns=1, fetch_local=False,
                            timeout=None if stop is None else STOP_POLL_S)
        return ready[0] if ready else None

    def _on_generated(self, job, done, pending: dict, out: Produced, tps: dict, shaping) -> bool:
        """A generate call ended: count it and send its rollouts to be scored; False if its
        generator died (the chunk went to another)."""
        self.pools.generators.release(job.replica)
        try:
            summary = ray.get(done)  # a GenerationSummary: counts only
        except RayActorError as e:
            self._recover(job, e, pending, out)
            return False
        out.skipped_prompts += len(summary.skipped_prompts)
        out.incomplete_kept_sets += summary.incomplete_kept_sets
        out.tokens += summary.generated_tokens
        out.episode_counts = add_counts(out.episode_counts, summary.episode_counts)
        tps.setdefault(job.replica, []).append(summary.tokens_per_second)
        pending.update(self._score(job.chunk_id, summary, job.rollouts_ref, shaping))
        return True

    def _on_scored(self, job, done, pending: dict, out: Produced) -> None:
        """A scorer call ended: free its slot and count its pull; once both of the chunk's scorers
        are done, send the put (which then waits in the buffer for the transfer only)."""
        job.pool.release(job.replica)
        out.score_latency.setdefault(job.stage, []).append(time.perf_counter() - job.started)
        try:
            out.to_scorers += ray.get(done)  # a Transfer: what the scorer's pull moved
        except RayError as e:  # the scorer died or failed, or the rollouts were lost with a node
            self._abandoned.append(job.put.output_of(job.stage))  # the same error: collected, not logged
            self._recover(job, e, pending, out)
            return
        put = job.put
        put.waiting -= 1
        if put.waiting == 0:
            ref = put.handle.put_chunk.remote(job.chunk_id, *map(Pull, put.refs), put.shaping,
                                              timeout=self.put_timeout_s, drop_flat_groups=self.filter_groups)
            pending[ref] = _InFlight("stored", job.chunk_id, put.buffer_id)

    # ------------------------------------------------------------------ replicas that died
    def buffer_died(self, buffer_id: str) -> None:
        """Replace the buffer (once, whichever thread saw it die first). What it held is
        queued again by recover_lost_buffer(), in the thread that applies the learner's takes."""
        detected = time.perf_counter()
        with self._store_lock:
            if self.pools.buffer_slot.replace(buffer_id):
                self._lost_buffer = buffer_id
                self.recoveries.append({"role": "buffer", "replica": buffer_id, "detected": detected,
                                        "serving": time.perf_counter()})

    def recover_lost_buffer(self) -> bool:
        """After a buffer died: queue every prompt it held (by the ledger) for generation.

        The driver calls this from the thread that applies each take's ``consumed`` pairs, so
        a take that finished just before the buffer died is accounted before its prompts
        could be queued again (which would train them twice). True if anything was queued."""
        with self._store_lock:
            lost, self._lost_buffer = self._lost_buffer, None
            chunks = self.ledger.release_stored() if lost else []
        if lost:
            log.warning("%s died; replaced it by %s, generating the %d prompts it held again", lost,
                        self.pools.buffer_slot.id, sum(len(c.prompt_indices) for c in chunks))
            self.requeue(chunks)
        return bool(chunks)

    def has_backlog(self) -> bool:
        """Chunks waiting to be generated again (async mode's producer runs them, admitted or not)."""
        with self._backlog_lock:
            return bool(self._backlog)

    @property
    def backlog(self) -> list:
        """The chunks waiting to be generated again, a snapshot."""
        with self._backlog_lock:
            return list(self._backlog)

    def requeue(self, chunks: list) -> None:
        """Chunks for the next produce() to generate (a restored run's unfinished prompts)."""
        with self._backlog_lock:
            self._backlog += chunks

    def reset(self) -> None:
        """Forget every chunk and the backlog: a rollback abandons them."""
        with self._backlog_lock:
            self._backlog = []
        self.ledger.reset()

    def _dispatch_backlog(self, pending: dict, out: Produced, stop: threading.Event | None = None) -> None:
        with self._backlog_lock:
            # Looked at under the lock a rollback re-queues under (after the stop): a stopped
            # producer that is still running can never take those chunks.
            if stop is not None and stop.is_set():
                return
            chunks, self._backlog = self._backlog, []
        for c in chunks:
            pending.update(self._generate(c))
            out.redispatched_chunks += 1

    def _recover(self, job, error: Exception, pending: dict, out: Produced) -> None:
        """Replace every dead replica the failed call involved; redispatch what they held."""
        chunk = self.ledger.get(job.chunk_id)
        dead = [(role, rid) for role, rid in chunk.replicas.items() if not self._alive(role, rid)]
        if not dead and lost_with_a_node(error):  # e.g. its rollouts, with the generator's node
            self._regenerate(chunk.id, pending, out)
            return
        if not dead:
            raise error  # no replica died: a genuine failure of the call
        for role, rid in dead:
            released, pool, detected = self.ledger.release(rid), None, time.perf_counter()
            if role == "buffer":
                self.buffer_died(rid)
            else:
                log.warning("%s died (%s); replacing it and redispatching its chunks", rid,
                            type(error).__name__)
                pool = self._pool(role)
                if not pool.remove(rid):  # it was leaving anyway: no replacement
                    pool = None
                elif len(pool) == 0:  # its last replica: nothing can run until one is back
                    pool, _ = None, self._add_replacement(pool, rid, detected)
            for c in released:  # to the live replicas at once, while a replacement starts
                self._forget(c.id, pending)
                pending.update(self._generate(c))
                out.redispatched_chunks += 1
            if pool is not None:
                self._add_replacement(pool, rid, detected)

    def _regenerate(self, chunk_id: int, pending: dict, out: Produced) -> None:
        """A scoring chunk whose input objects were lost (their node died, though every replica
        it now uses lives): generate it again. The replica that made them is found dead, and
        replaced, when it is next given work."""
        log.warning("chunk %d: its rollouts were lost with a node; generating them again", chunk_id)
        self._forget(chunk_id, pending)
        chunk = self.ledger.reopen(chunk_id)
        if chunk is not None:
            pending.update(self._generate(chunk))
            out.redispatched_chunks += 1

    def _add_replacement(self, pool, dead_id: str, detected: float) -> None:
        (new_id,) = pool.add(1)
        if pool is self.pools.generators:
            self.on_new_generator(new_id)
        self.recoveries.append({"role": pool.role, "replica": dead_id, "replacement": new_id,
                                "detected": detected, "serving": time.perf_counter()})

    def _forget(self, chunk_id: int | None, pending: dict) -> None:
        """Drop a released chunk's outstanding calls (None: every call, on a stop), freeing the
        live replicas' slots."""
        for ref, job in list(pending.items()):
            if chunk_id is None or job.chunk_id == chunk_id:
                del pending[ref]
                self._abandoned.append(ref)
                pool = self.pools.generators if job.stage == "generated" else job.pool
                if pool is not None:
                    pool.release(job.replica)

    def _pool(self, role: str):
        return self.pools.by_role()[role]

    def _alive(self, role: str, replica_id: str) -> bool:
        if role == "buffer":
            slot = self.pools.buffer_slot
            return slot.id == replica_id and alive(slot.handle, self.health_timeout_s)
        handle = self._pool(role).handle(replica_id)
        return handle is not None and alive(handle, self.health_timeout_s)

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
        refs, rewards, buffer = self.pools.references, self.pools.rewards, self.pools.buffer_slot
        ref, rew = refs.acquire(), rewards.acquire()
        self.ledger.scoring(chunk_id, ref.id, rew.id, buffer.id)
        ref_lp, ref_moved = ref.handle.reference_logprobs_pulled.options(num_returns=2).remote(Pull(rollouts_ref))
        scores, rew_moved = rew.handle.score_rollouts_pulled.options(num_returns=2).remote(Pull(rollouts_ref))
        put = _Put(buffer.id, buffer.handle, (rollouts_ref, ref_lp, scores), shaping)  # the ledger's buffer
        return {ref_moved: _InFlight("reference", chunk_id, ref.id, pool=refs, put=put),
                rew_moved: _InFlight("reward", chunk_id, rew.id, pool=rewards, put=put)}

    def _record(self, out: Produced, report, buffer_id: str) -> bool:
        """Account a put's report; False (chunk reopened, to redo) if its buffer has died since."""
        out.to_buffer += report.transfer  # it moved, wherever it went
        with self._store_lock:
            if buffer_id != self.pools.buffer_slot.id:
                self.ledger.reopen(report.chunk_id)
                return False
            self.ledger.stored(report.chunk_id, dict(report.held))  # in the buffer either way
        for err in report.errors:
            log.warning("reward: %s", err)
        if report.duplicate:  # an earlier copy of this chunk was stored: count it once
            out.duplicate_chunks += 1
            return True
        out.stored += report.stored
        out.filtered_prompts += report.filtered_prompts
        out.invalid_scores += report.invalid_scores
        out.empty_responses += report.empty_responses
        for k, v in report.reward_counts:
            out.reward_counts[k] = out.reward_counts.get(k, 0) + v
        return True


@dataclass
class _InFlight:
    """One remote call of a chunk's life that the dispatcher waits on."""
    stage: str                    # "generated" | "reference" | "reward" | "stored"
    chunk_id: int
    replica: str | None
    pool: object = None           # the pool to release the replica to (scorers)
    rollouts_ref: object = None   # generation: the rollouts, left in the object store
    put: "_Put" = None            # scorers: their chunk's put, sent once both are done
    started: float = field(default_factory=time.perf_counter)


@dataclass
class _Put:
    """A chunk's buffer.put_chunk, waiting for its reference and reward calls to end."""
    buffer_id: str
    handle: object
    refs: tuple                   # rollouts, reference log-probs, scores: each goes in a Pull
    shaping: object
    waiting: int = 2              # scorer calls not done yet

    def output_of(self, stage: str):
        """The result object of the chunk's scorer call ``stage`` ("reference" | "reward")."""
        return self.refs[1 if stage == "reference" else 2]

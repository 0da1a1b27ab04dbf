"""RolloutBuffer: the bounded, version-tagged queue between the rollout side and the learner.

Run it as a *threaded* Ray actor, e.g. ``ray.remote(max_concurrency=k)(RolloutBuffer)``:
put and get block inside the actor (backpressure), so k must exceed the number of
callers that can be blocked at once (producers + consumers) by at least one, or
stats()/health() calls queue behind them. All state sits behind one
``threading.Condition``, which is what makes it correct with concurrent threads;
as a plain object it works the same from several Python threads.

Semantics
* put(items) is all-or-nothing: it waits until there is room for every item, so a
  TimeoutError means nothing was put and the same call can be retried without
  duplicates. Waiting puts are served in arrival order, so a large batch is not
  starved by a stream of small ones. Returns len(items).
* get(n, min_version) first discards (and counts as dropped_stale) every buffered
  item with policy_version < min_version, then waits for n items and returns the
  oldest n in put order (FIFO), and on to the end of the n-th one's prompt group.
* A prompt group is the samples of one prompt that one put_chunk stored (same chunk id
  and prompt index); an item put without a chunk id is a group of one. A group leaves
  the buffer whole, in one get or one stale discard, so a step never trains part of a
  prompt's samples and leaves the rest to a later step, or to a rollback that would lose
  them (the driver's ledger counts a prompt done once it left). So a get returns more
  than n items (less than a group more) when the n-th is not the last of its group: the
  driver asks for prompts x generator.sampling.n, but an invalid reward leaves a group
  short. A group with one stale sample is discarded whole.
* Staleness of a gotten item = reference version - item.policy_version, where the
  reference version is get's ``current_version`` when the caller passes it (the
  learner's version) and otherwise the newest policy_version ever put.
* n > capacity, or a put of more than capacity items, can never be satisfied and
  raises ValueError instead of blocking forever.
* close() wakes every waiter with BufferClosed, for a clean shutdown.

By reference (what the driver uses): put_chunk(chunk_id, rollouts, reference_logprobs,
scores, shaping) receives the generator's and the scorers' outputs as Ray object
references wrapped in core.infra.transfer.Pull, which it pulls here, in the buffer's process,
measuring what crossed nodes (ChunkReport.transfer; plain values work too). The driver
sends it once the scorers are done, so a put holds one of the buffer's threads for the
transfer only, never while a scorer computes. The KL annotation runs here too, so
scored rollouts never pass through the driver. A chunk id is stored at
most once: a second put_chunk of the same id (a redispatched chunk whose first put did
land) stores nothing and says so. take(n, world_size, ...) returns the learner shards
and a BatchSummary as separate objects (call it with ``num_returns=world_size + 1``):
each rank then receives its shard by reference.
"""
from __future__ import annotations

import collections
import itertools
import os
import threading
import time
from dataclasses import dataclass
from typing import Optional

from actors.rewards.composed import attach_components
from core.annotate import RewardShaping, annotate_valid
from core.infra.transfer import Transfer, pull_args
from core.rollout import BatchSummary, FrozenLogprobs, ScoredRollout, shard_rollouts, staleness


@dataclass(frozen=True)
class ChunkReport:
    """What put_chunk did with one prompt chunk: counts and one-line messages only."""
    chunk_id: int
    stored: int = 0               # scored rollouts now in the buffer
    invalid_scores: int = 0       # reward was NaN/inf or raised: left out
    empty_responses: int = 0      # nothing to put a reward on: left out
    errors: tuple = ()            # one line per reward problem
    held: tuple = ()              # (prompt_index, rollouts stored) for each prompt now in the buffer
    duplicate: bool = False       # this chunk id was stored before: nothing stored now
    filtered_prompts: int = 0     # prompts left out because their samples all scored the same
    filtered_rollouts: int = 0    # the rollouts of those prompts
    transfer: Transfer = Transfer()  # what pulling the chunk's objects moved between nodes
    reward_counts: tuple = ()     # (name, number): the reward call's counters (ScoreResult.counts)


def _prompt_group(x: ScoredRollout):
    """(chunk id, prompt index): the group an item leaves the buffer with; None (a group of
    one) for an item put without a chunk id."""
    return (x.chunk_id, x.prompt_index) if x.chunk_id >= 0 else None


def flat_groups(scored: list) -> set:
    """Prompt indices whose samples (two or more) all have the same score."""
    scores: dict = collections.defaultdict(list)
    for x in scored:
        scores[x.prompt_index].append(x.score)
    return {i for i, s in scores.items() if len(s) > 1 and max(s) == min(s)}


def group_end(items, n: int) -> int:
    """How many of ``items`` (a sequence, groups side by side) the first n are, with the rest
    of the n-th one's prompt group."""
    n = min(n, len(items))
    last = _prompt_group(items[n - 1]) if n else None
    while last is not None and n < len(items) and _prompt_group(items[n]) == last:
        n += 1
    return n


def first_groups(items: list, n: int) -> tuple[list, list]:
    """(kept, surplus): whole prompt groups in (chunk id, prompt index) order until ``n``
    rollouts are kept, and the rest. Chunk ids are issued in order, so the choice does not
    depend on which generator finished first."""
    ordered = sorted(items, key=lambda x: (x.chunk_id, x.prompt_index, x.sample_index))
    cut = group_end(ordered, n)
    return ordered[:cut], ordered[cut:]


class BufferClosed(RuntimeError):
    """The buffer was closed while a caller waited on it (or before it called)."""


class RolloutBuffer:
    def __init__(self, *, capacity: int):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"RolloutBuffer: capacity must be an int >= 1, got {capacity!r}")
        self.capacity = capacity
        self._items: collections.deque[ScoredRollout] = collections.deque()
        self._cond = threading.Condition()
        self._put_turns: collections.deque[int] = collections.deque()
        self._tickets = itertools.count()
        self._closed = False
        self._latest_version: Optional[int] = None
        self._waiting_gets = 0
        self._put_total = self._got_total = self._dropped_stale = 0
        self._staleness_sum = 0
        self._staleness_max = 0
        self._chunks: dict[int, tuple] = {}  # id -> held, for every chunk stored so far (exactly-once)
        self._chunks_pending: set[int] = set()  # ids whose put is under way
        self._left: list[tuple[int, int]] = []  # (chunk_id, prompt_index) discarded since the last take

    def put(self, items: list[ScoredRollout], timeout: Optional[float] = None) -> int:
        """Append items (all or none), blocking while the buffer lacks room.

        timeout None waits forever; on expiry raises TimeoutError and nothing is put.
        """
        items = list(items)
        for x in items:
            if not isinstance(x, ScoredRollout):
                raise TypeError(f"RolloutBuffer.put: expected ScoredRollout, got {type(x).__name__}")
        if len(items) > self.capacity:
            raise ValueError(f"RolloutBuffer.put: {len(items)} items can never fit in capacity "
                             f"{self.capacity}; split the batch")
        if not items:
            return 0
        with self._cond:
            self._check_open("put")
            ticket = next(self._tickets)
            self._put_turns.append(ticket)
            try:
                fits = lambda: (self._closed or (self._put_turns[0] == ticket
                                                 and len(self._items) + len(items) <= self.capacity))
                if not self._cond.wait_for(fits, timeout):
                    raise TimeoutError(
                        f"buffer: put of {len(items)} rollouts waited {timeout}s for room "
                        f"(depth {len(self._items)}/{self.capacity}); nothing was put")
                self._check_open("put")
                self._items.extend(items)
                self._put_total += len(items)
                newest = max(x.policy_version for x in items)
                if self._latest_version is None or newest > self._latest_version:
                    self._latest_version = newest
                return len(items)
            finally:
                self._put_turns.remove(ticket)
                self._cond.notify_all()  # the next put in line, and getters, re-check

    def get(self, n: int, min_version: int = 0, timeout: Optional[float] = None,
            current_version: Optional[int] = None) -> list[ScoredRollout]:
        """Return the oldest n items and the rest of the n-th one's prompt group, none older
        than min_version.

        Blocks until n fresh items are buffered; on expiry raises TimeoutError and
        takes nothing (stale items discarded meanwhile stay discarded). The rest of the
        group is here already: put_chunk puts a chunk's groups whole.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"RolloutBuffer.get: n must be an int >= 1, got {n!r}")
        if n > self.capacity:
            raise ValueError(f"RolloutBuffer.get: n={n} exceeds capacity {self.capacity}; "
                             "the buffer could never hold that many (deadlock)")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._waiting_gets += 1
            try:
                while True:
                    if self._discard_stale(min_version):
                        self._cond.notify_all()  # freed room for waiting puts
                    if len(self._items) >= n:
                        break
                    self._check_open("get")
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(f"buffer: waited {timeout}s for {n} rollouts, have {len(self._items)}")
                    self._cond.wait(remaining)
                out = [self._items.popleft() for _ in range(group_end(self._items, n))]
                self._got_total += len(out)
                ref = current_version if current_version is not None else self._latest_version
                lag = staleness(out, ref)
                self._staleness_sum += int(lag.sum())
                self._staleness_max = max(self._staleness_max, int(lag.max()))
                self._cond.notify_all()
                return out
            finally:
                self._waiting_gets -= 1

    def put_chunk(self, chunk_id: int, rollouts: list, reference_logprobs, scores,
                  shaping: RewardShaping, timeout: Optional[float] = None,
                  drop_flat_groups: bool = False) -> ChunkReport:
        """Annotate one chunk's rollouts (scores: the reward's ScoreResult) and put them, once.

        ``reference_logprobs``: a reference replica's FrozenLogprobs (the teacher's too, where it
        hosts one) or a plain list of the reference's (core.rollout.FrozenLogprobs.of).
        Each of rollouts, reference_logprobs and scores is a value or a core.infra.transfer.Pull
        (pulled here; a lost object raises as ray.get does, and nothing is stored). A duplicate
        chunk id (already stored, or being stored right now) pulls and stores nothing.
        ``drop_flat_groups`` (dynamic sampling): a prompt whose valid samples, two or more, all
        scored the same is left out: it would teach a group estimator nothing.
        """
        with self._cond:
            if chunk_id in self._chunks or chunk_id in self._chunks_pending:
                return ChunkReport(chunk_id, duplicate=True, held=self._chunks.get(chunk_id, ()))
            self._chunks_pending.add(chunk_id)
        try:
            (rollouts, frozen, scores), moved = pull_args(rollouts, reference_logprobs, scores)
            frozen = FrozenLogprobs.of(frozen)
            scored, invalid, empty = annotate_valid(rollouts, frozen.reference, scores.scores,
                                                    scores.valid, shaping, teacher_logprobs=frozen.teacher)
            for x in scored:
                x.chunk_id = chunk_id
            attach_components(scored, rollouts, scores)
            order: dict = {}
            for x in scored:
                order.setdefault(x.prompt_index, len(order))
            scored.sort(key=lambda x: order[x.prompt_index])  # a prompt's samples side by side: one group
            flat = flat_groups(scored) if drop_flat_groups else set()
            kept = [x for x in scored if x.prompt_index not in flat]
            filtered = len(scored) - len(kept)
            scored = kept
            held = tuple(sorted(collections.Counter(x.prompt_index for x in scored).items()))
            self.put(scored, timeout=timeout)
            with self._cond:
                self._chunks[chunk_id] = held
        finally:
            with self._cond:
                self._chunks_pending.discard(chunk_id)
        return ChunkReport(chunk_id, stored=len(scored), invalid_scores=invalid, empty_responses=empty,
                           errors=tuple(scores.errors), held=held, transfer=moved,
                           filtered_prompts=len(flat), filtered_rollouts=filtered,
                           reward_counts=tuple(scores.counts.items()))

    def take(self, n: int, *, world_size: int, min_version: int = 0, current_version: int = 0,
             timeout: Optional[float] = None, drop_surplus: bool = False) -> tuple:
        """get() n rollouts (whole prompt groups: maybe more) and split them for the learner:
        (shard_0, ..., shard_{W-1}, BatchSummary). ``drop_surplus`` (dynamic sampling after a
        refill): the batch is the first whole groups in (chunk, prompt) order that make n,
        whatever order they arrived in, and every other rollout held is left out."""
        items = self.get(n, min_version=min_version, timeout=timeout, current_version=current_version)
        surplus: list = []
        with self._cond:
            if drop_surplus:
                items, surplus = first_groups(items + list(self._items), n)
                self._items.clear()
                self._cond.notify_all()  # room for waiting puts
            left, self._left = self._left, []
            depth, dropped_stale = len(self._items), self._dropped_stale
        consumed = left + [(x.chunk_id, x.prompt_index) for x in items + surplus]
        shards = shard_rollouts(items, world_size)
        # The buffer's own figures travel with the batch: no second call to a buffer that may
        # have died since.
        return (*shards, BatchSummary.of(items, current_version=current_version, consumed=consumed,
                                         buffer_depth=depth, dropped_stale=dropped_stale,
                                         surplus=len(surplus)))

    def _discard_stale(self, min_version: int) -> int:
        # Versions interleave when several generators put, so scan everything, not just the head.
        stale = [x for x in self._items if x.policy_version < min_version]
        if not stale:
            return 0
        # Samples of one prompt can differ in version (a weight push mid-generation): one stale
        # sample takes its whole group along.
        groups = {_prompt_group(x) for x in stale} - {None}
        gone = lambda x: x.policy_version < min_version or _prompt_group(x) in groups  # noqa: E731
        fresh = [x for x in self._items if not gone(x)]
        self._left += [(x.chunk_id, x.prompt_index) for x in self._items if gone(x)]
        dropped = len(self._items) - len(fresh)
        self._items = collections.deque(fresh)
        self._dropped_stale += dropped
        return dropped

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise BufferClosed(f"buffer: {op} on a closed buffer")

    def close(self) -> None:
        """Wake every waiter with BufferClosed; buffered items stay gettable."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def stats(self) -> dict:
        with self._cond:
            return {
                "depth": len(self._items), "capacity": self.capacity,
                "put_total": self._put_total, "got_total": self._got_total,
                "dropped_stale": self._dropped_stale,
                "mean_staleness": self._staleness_sum / self._got_total if self._got_total else 0.0,
                "max_staleness": self._staleness_max, "latest_version": self._latest_version,
                "waiting_puts": len(self._put_turns), "waiting_gets": self._waiting_gets,
                "chunks_stored": len(self._chunks), "closed": self._closed,
            }

    def health(self) -> dict:
        with self._cond:
            return {"role": "buffer", "ok": not self._closed, "pid": os.getpid(), "depth": len(self._items),
                    "capacity": self.capacity}

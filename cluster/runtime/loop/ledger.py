"""The ledger of prompt chunks: where every in-flight chunk is, so none is lost or counted twice.

A chunk is a slice of one step's prompts. Its life:

    pending --dispatch--> generating --generated--> scoring --stored--> stored --consumed--> (gone)
       ^                      |                        |                  |
       +------ release(replica) (the replica left the pool) ------+       |
       +------ release_stored() (the buffer died with the chunk in it) ---+

A stored chunk stays in the ledger while the buffer holds any of its rollouts
(``held``: prompt index -> rollouts); the learner's take reports which prompts left
the buffer (``consumed``), trained on or dropped as stale. The unit is the prompt: the
buffer moves a prompt's samples out together (actors/buffer.py, prompt groups), so a
prompt that left is wholly trained or dropped, and one still held is wholly unfinished.
So when the buffer dies, or a checkpoint lists the unfinished prompts for a rollback or
a resume, the ledger knows exactly which prompts are lost, and they are generated again.

Exactly-once: a chunk id is stored at most once. The buffer refuses a second put of
the same id (a redispatched chunk whose first put landed after all), and the ledger
refuses to mark a chunk stored twice; so a chunk redispatched after its replica died
is counted once whichever copy arrives. Plain Python, no Ray: unit-testable.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from enum import Enum


class ChunkState(str, Enum):
    PENDING = "pending"          # waiting for a generator
    GENERATING = "generating"
    SCORING = "scoring"          # reference + reward + buffer put under way
    STORED = "stored"            # in the buffer (or nothing to store): done


@dataclass
class Chunk:
    id: int
    prompt_indices: list          # positions in the dataset
    prompt_ids: list              # [P] token arrays, one per prompt
    state: ChunkState = ChunkState.PENDING
    replicas: dict = field(default_factory=dict)  # role -> replica id now holding it
    attempts: int = 0             # dispatches so far (> 1 after a redispatch)
    held: dict = field(default_factory=dict)  # stored: prompt index -> rollouts the buffer holds
    consumed: set = field(default_factory=set)  # prompt indices the learner took (never redone)


class Ledger:
    """chunk id -> (state, replicas). Thread-safe: async mode's producer and the driver share it."""

    def __init__(self) -> None:
        self._chunks: dict[int, Chunk] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def open(self, prompt_indices: list, prompt_ids: list) -> Chunk:
        with self._lock:
            chunk = Chunk(next(self._ids), list(prompt_indices), list(prompt_ids))
            self._chunks[chunk.id] = chunk
            return chunk

    def generating(self, chunk_id: int, generator: str) -> None:
        with self._lock:
            c = self._live(chunk_id, ChunkState.PENDING)
            c.state, c.replicas, c.attempts = ChunkState.GENERATING, {"generator": generator}, c.attempts + 1

    def scoring(self, chunk_id: int, reference: str, reward: str, buffer: str) -> None:
        with self._lock:
            c = self._live(chunk_id, ChunkState.GENERATING)
            # The rollouts now sit in the object store: the generator is no longer needed.
            c.state, c.replicas = ChunkState.SCORING, {"reference": reference, "reward": reward,
                                                       "buffer": buffer}

    def stored(self, chunk_id: int, held: dict | None = None) -> bool:
        """Mark the chunk stored, the buffer holding ``held`` (prompt index -> rollouts);
        False (and no change) if it was already stored."""
        with self._lock:
            c = self._chunks[chunk_id]
            if c.state is ChunkState.STORED:
                return False
            # A take can report a prompt before the put's own report arrives here.
            c.state, c.replicas = ChunkState.STORED, {}
            c.held = {i: n for i, n in (held or {}).items() if i not in c.consumed}
            return True

    def consumed(self, pairs) -> None:
        """(chunk_id, prompt_index) pairs that left the buffer. A prompt counts as consumed once
        any of its rollouts left (the learner trained on it), so it is never generated twice;
        the buffer never leaves some of its samples behind."""
        with self._lock:
            for chunk_id, prompt_index in pairs:
                c = self._chunks.get(chunk_id)
                if c is not None:  # stored, or its put's report is still on the way
                    c.consumed.add(prompt_index)
                    c.held.pop(prompt_index, None)

    def reopen(self, chunk_id: int) -> Chunk | None:
        """One scoring chunk back to pending (its put landed in a buffer that has died since);
        None if the learner already took all its prompts."""
        with self._lock:
            c = self._live(chunk_id, ChunkState.SCORING)
            c.state, c.replicas = ChunkState.PENDING, {}
            return c if self._drop_consumed(c) else None

    def _drop_consumed(self, c: Chunk) -> bool:
        """Keep only the prompts the learner has not taken; False (chunk done) if none is left."""
        keep = [k for k, idx in enumerate(c.prompt_indices) if idx not in c.consumed]
        c.prompt_indices = [c.prompt_indices[k] for k in keep]
        c.prompt_ids = [c.prompt_ids[k] for k in keep]
        if not keep:
            c.state, c.replicas, c.held = ChunkState.STORED, {}, {}
        return bool(keep)

    def release_stored(self) -> list[Chunk]:
        """The buffer died: every stored chunk's held prompts go back to pending (to be
        generated again); returned. Prompts already consumed are not repeated."""
        with self._lock:
            out = []
            for c in self._chunks.values():
                if c.state is ChunkState.STORED and c.held:
                    keep = [k for k, idx in enumerate(c.prompt_indices) if idx in c.held]
                    c.prompt_indices = [c.prompt_indices[k] for k in keep]
                    c.prompt_ids = [c.prompt_ids[k] for k in keep]
                    c.state, c.held = ChunkState.PENDING, {}
                    out.append(c)
            return out

    def held_rollouts(self) -> int:
        """Rollouts the buffer holds, by the ledger's account."""
        with self._lock:
            return sum(sum(c.held.values()) for c in self._chunks.values() if c.state is ChunkState.STORED)

    def unfinished_prompts(self) -> list[int]:
        """Prompt indices issued and not yet consumed: in flight, or held by the buffer."""
        with self._lock:
            out = []
            for c in self._chunks.values():
                out += list(c.held) if c.state is ChunkState.STORED else \
                    [i for i in c.prompt_indices if i not in c.consumed]
            return out

    def release(self, replica: str) -> list[Chunk]:
        """Chunks in flight on ``replica`` go back to pending (to be redispatched); returned."""
        with self._lock:
            out = [c for c in self._chunks.values()
                   if c.state in (ChunkState.GENERATING, ChunkState.SCORING) and replica in c.replicas.values()]
            for c in out:
                c.state, c.replicas = ChunkState.PENDING, {}
            return [c for c in out if self._drop_consumed(c)]

    def in_flight(self) -> list[Chunk]:
        with self._lock:
            return [c for c in self._chunks.values() if c.state is not ChunkState.STORED]

    def forget_stored(self) -> None:
        """Drop chunks stored and wholly consumed (their ids stay used): keeps the ledger small."""
        with self._lock:
            self._chunks = {i: c for i, c in self._chunks.items()
                            if c.state is not ChunkState.STORED or c.held}

    def reset(self) -> None:
        """Forget every chunk (a rollback to a checkpoint discards the timeline they belong to)."""
        with self._lock:
            self._chunks = {}

    def get(self, chunk_id: int) -> Chunk:
        with self._lock:
            return self._chunks[chunk_id]

    def _live(self, chunk_id: int, expected: ChunkState) -> Chunk:
        c = self._chunks[chunk_id]
        if c.state is not expected:
            raise RuntimeError(f"ledger: chunk {chunk_id} is {c.state.value}, expected {expected.value}")
        return c

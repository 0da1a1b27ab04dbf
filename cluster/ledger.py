"""The ledger of prompt chunks: where every in-flight chunk is, so none is lost or counted twice.

A chunk is a slice of one step's prompts. Its life:

    pending --dispatch--> generating --generated--> scoring --stored--> stored
       ^                      |                        |
       +------ release(replica) (the replica left the pool) ------+

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

    def scoring(self, chunk_id: int, reference: str, reward: str) -> None:
        with self._lock:
            c = self._live(chunk_id, ChunkState.GENERATING)
            # The rollouts now sit in the object store: the generator is no longer needed.
            c.state, c.replicas = ChunkState.SCORING, {"reference": reference, "reward": reward}

    def stored(self, chunk_id: int) -> bool:
        """Mark the chunk done; False (and no change) if it was already stored."""
        with self._lock:
            c = self._chunks[chunk_id]
            if c.state is ChunkState.STORED:
                return False
            c.state = ChunkState.STORED
            c.replicas = {}
            return True

    def release(self, replica: str) -> list[Chunk]:
        """Chunks in flight on ``replica`` go back to pending (to be redispatched); returned."""
        with self._lock:
            out = [c for c in self._chunks.values()
                   if c.state in (ChunkState.GENERATING, ChunkState.SCORING) and replica in c.replicas.values()]
            for c in out:
                c.state, c.replicas = ChunkState.PENDING, {}
            return out

    def in_flight(self) -> list[Chunk]:
        with self._lock:
            return [c for c in self._chunks.values() if c.state is not ChunkState.STORED]

    def forget_stored(self) -> None:
        """Drop finished chunks (their ids stay used): keeps the ledger small over a long run."""
        with self._lock:
            self._chunks = {i: c for i, c in self._chunks.items() if c.state is not ChunkState.STORED}

    def get(self, chunk_id: int) -> Chunk:
        with self._lock:
            return self._chunks[chunk_id]

    def _live(self, chunk_id: int, expected: ChunkState) -> Chunk:
        c = self._chunks[chunk_id]
        if c.state is not expected:
            raise RuntimeError(f"ledger: chunk {chunk_id} is {c.state.value}, expected {expected.value}")
        return c

"""The reference pool when the learner scores the reference (``reference.on_learner``).

A LoRA run's reference is its base model, which learner rank 0 already holds: the policy with its
adapter switched off (``PPOObjective.reference_logprobs``). ``LearnerReference`` stands where the
reference Pool stands, so the dispatcher scores a chunk on it as on any reference replica, and
its one replica is learner rank 0 (``learner-0``, whatever actor the group runs as rank 0 now).

Rank 0 scores alone: its forward needs no collective with ZeRO 0-2, or with ZeRO-3 on one rank
(the config refuses ZeRO-3 on several). Its calls queue behind the learner's own on that actor:
in sync mode scoring and learning take turns anyway; in async mode a chunk's reference waits for
an update in progress. If rank 0 dies, the run rolls back as for any dead learner rank
(``LearnerRankDied``); the pool is never resized.
"""
from __future__ import annotations

import threading

from cluster.runtime.pools.placement import PlacementError
from cluster.runtime.pools.pool import Replica
from cluster.runtime.pools.stand_in import StandIn
from learner.group import LearnerRankDied

REPLICA = "learner-0"


class LearnerReference(StandIn):
    """The reference "pool" of one replica, learner rank 0 of ``learner`` (a LearnerGroup)."""

    role = "reference"
    replica_id = REPLICA

    def __init__(self, learner) -> None:
        self.learner = learner
        self._load, self._lock = 0, threading.Lock()

    def _replica(self) -> Replica:
        return Replica(id=REPLICA, handle=self.learner.workers[0], placement_group=None, load=self._load)

    # ---- dispatch, as Pool
    def acquire(self) -> Replica:
        with self._lock:
            self._load += 1
            return self._replica()

    def release(self, replica_id: str) -> None:
        with self._lock:
            self._load = max(0, self._load - 1)

    def remove(self, replica_id: str) -> bool:
        """Rank 0 died: not a replica to replace but a learner rank, so the run rolls back."""
        raise LearnerRankDied(0, "a reference call (reference.on_learner)", "its actor is gone")

    def add(self, n: int = 1) -> list[str]:
        raise PlacementError("reference.on_learner: learner rank 0 scores the reference; there is no reference "
                             "pool to resize (a run started with reference.on_learner=false has one)")

    def resize(self, n: int) -> tuple[list[str], list[str]]:
        return self.add(n) if n != 1 else ([], [])

    # ---- views, as Pool (the rest: StandIn)
    def first(self):
        return self.learner.workers[0]

    def __len__(self) -> int:
        return 1

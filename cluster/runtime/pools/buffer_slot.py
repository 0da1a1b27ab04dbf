"""The run's one rollout buffer, in a slot that a replacement can take over (cluster/runtime/pools/pool.py
holds the other pools)."""
from __future__ import annotations

import itertools
import threading

import ray
from ray.exceptions import RayActorError

from actors.buffer import RolloutBuffer
from cluster.config.labels import parse_labels
from cluster.runtime.pools.placement import PlacementError, cannot_place, carrying
from core.infra.node_loss import off_nodes, start_placed


class BufferSlot:
    """The run's one rollout buffer, replaceable: a dead buffer gives way to a fresh, empty
    one under a new name (buffer-0, buffer-1, ...). What the dead one held is not restored
    from it: the ledger knows those prompts and the producer generates them again."""

    def __init__(self, *, capacity: int, env: dict, node_labels: str | None = None,
                 placement_timeout_s: float = 60.0) -> None:
        self._capacity, self._env = capacity, env
        self._labels, self._timeout_s = parse_labels(node_labels), placement_timeout_s
        self._serial, self._lock = itertools.count(), threading.Lock()
        self.id, self.handle = self._start()

    def _start(self):
        """A new buffer, started again off a node that died under it (core/infra/node_loss.py)."""
        return start_placed(self._start_off, errors=(RayActorError,), timeout_s=self._timeout_s, what="buffer")

    def _start_off(self, avoid: frozenset):
        rid = f"buffer-{next(self._serial)}"
        selector = {**self._labels, **off_nodes(avoid)}
        # Many producers may block in put() at once; leave room for stats()/health().
        handle = ray.remote(RolloutBuffer).options(name=rid, num_cpus=0, max_concurrency=16,
                                                   runtime_env={"env_vars": self._env},
                                                   **({"label_selector": selector} if selector else {})).remote(
            capacity=self._capacity)
        self._wait_started(handle)
        ray.get(handle.health.remote())
        return rid, handle

    def _wait_started(self, handle) -> None:
        """With node labels: PlacementError if no alive node carries them after the timeout
        (a matching node that is merely slow to start the buffer is waited for)."""
        if not self._labels:
            return
        ready, _ = ray.wait([handle.health.remote()], timeout=self._timeout_s)
        if not ready and not carrying(self._labels):
            ray.kill(handle)
            raise PlacementError(cannot_place("buffer", 1, {"CPU": 0.0}, self._timeout_s, self._labels))

    def replace(self, dead_id: str) -> bool:
        """Start a new buffer if ``dead_id`` is still the current one; False if another
        thread did so already."""
        with self._lock:
            if self.id != dead_id:
                return False
            self.shutdown()
            self.id, self.handle = self._start()
            return True

    def shutdown(self) -> None:
        try:
            ray.kill(self.handle)
        except Exception:  # noqa: BLE001 - already dead is fine
            pass

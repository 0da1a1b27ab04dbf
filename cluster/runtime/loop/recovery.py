"""Recovery from the failures the driver meets itself (docs/design/runtime.md, "Failure semantics").

A dead rollout-side replica or buffer is handled where the rollouts are made
(cluster/runtime/loop/dispatch.py). Here:

* a dead learner rank rolls the whole run back to its last checkpoint, in the same job
  (``Recovery.roll_back``), after the producer has stopped for certain;
* a weight push that meets a dead generator goes to the live ones (``push_weights``): the
  producer replaces the dead one, and the replacement gets the weights before it serves.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from cluster.runtime.loop.producer_thread import ProducerStuck
from cluster.runtime.pools.pool import alive
from cluster.runtime.state import checkpoint
from learner.group import LearnerRankDied

log = logging.getLogger("tether")


def live_generators(generators: dict) -> dict:
    """The generators (replica id -> handle) that answer health()."""
    return {rid: g for rid, g in generators.items() if alive(g)}


def push_weights(learner, generators: dict, version: int) -> dict:
    """``learner``'s weights to ``generators`` (replica id -> handle); one that died since it was
    last used is skipped. A dead learner rank is raised (LearnerRankDied): that is a rollback."""
    try:
        return learner.push_weights(generators, version)
    except LearnerRankDied:
        raise
    except RuntimeError:
        live = live_generators(generators)
        if len(live) == len(generators):
            raise
        log.warning("weight push: %s died; pushed to the others", ", ".join(sorted(set(generators) - set(live))))
        return learner.push_weights(live, version)


class Recovery:
    """Rolls the run back to its last checkpoint when a learner rank dies, in the same job.

    ``run`` is what is restored (the Driver: its ``restore(path)`` and ``step_count``), ``producer``
    the run's StepProducer, ``rollouts`` its ChunkDispatcher; ``learner_lock`` keeps learner
    collectives of two threads from interleaving."""

    def __init__(self, *, run, pools, rollouts, producer, learner_lock: threading.Lock, run_dir: Path,
                 placement_timeout_s: float = 600.0) -> None:
        self._run, self._pools, self._rollouts, self._producer = run, pools, rollouts, producer
        self._learner_lock, self._run_dir, self._placement_timeout_s = learner_lock, run_dir, placement_timeout_s

    def roll_back(self, error: LearnerRankDied) -> dict:
        """A learner rank died (the step being made is abandoned): the producer stopped, a fresh
        buffer and ledger, new learner ranks, the run restored to the last checkpoint and the
        producer started again. Returns the rollback's record."""
        detected_at = time.perf_counter()  # the death was just reported: this is when it was detected
        log.warning("%s; rebuilding the learner and rolling back to the last checkpoint", error)
        failed_at = self._run.step_count
        self.stop_producer()
        slot = self._pools.buffer_slot
        slot.replace(slot.id)  # rollouts of the abandoned steps must not be trained on
        self._rollouts.reset()
        with self._learner_lock:
            self._pools.learner.restart(self._placement_timeout_s)
        t_rebuilt = time.perf_counter()
        path = checkpoint.latest(self._run_dir)
        state = self._run.restore(path)
        record = {"rank": error.rank, "failed_at_step": failed_at, "resumed_at_step": state.step,
                  "detected_at": detected_at, "rebuild_seconds": t_rebuilt - detected_at,
                  "recovery_seconds": time.perf_counter() - detected_at}
        log.warning("learner recovered in %.1fs: back at step %d (version %d) from %s",
                    record["recovery_seconds"], state.step, state.version, path or "the initial weights")
        self._producer.start()
        return record

    def stop_producer(self) -> None:
        """Stop the producer for certain before the rollback re-queues prompts it could take; a
        stuck one fails the rollback in one line."""
        try:
            self._producer.stop()
        except ProducerStuck as e:
            raise ProducerStuck(f"rollback: {e}, and could take the prompts the rollback re-queues; "
                                f"resume the run with run.resume={self._run_dir}") from None

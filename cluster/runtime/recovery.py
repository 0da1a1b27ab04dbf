"""Recovery from the failures the driver meets itself (docs/design.md, "Failure semantics").

A dead rollout-side replica or buffer is handled where the rollouts are made
(cluster/runtime/rollouts.py). Here:

* a dead learner rank rolls the whole run back to its last checkpoint, in the same job
  (``roll_back``), after async mode's producer has stopped for certain (``stop_producer``);
* a weight push that meets a dead generator goes to the live ones (``push_weights``): the
  producer replaces the dead one, and the replacement gets the weights before it serves.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

from cluster.runtime import checkpoint
from cluster.runtime.background import ProducerStuck
from cluster.runtime.checkpoint import RunState
from cluster.runtime.pools import alive
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


def stop_producer(producer, *, timeout_s: float, run_dir: Path, at_end: bool = False) -> None:
    """Stop async mode's producer for certain: one still running could take the prompts a rollback
    re-queues next. A stuck one fails the rollback in one line (at the run's end: a warning)."""
    if producer is None or producer.stopping:  # stopped before: a stuck stop was reported then
        return
    producer.stop()
    try:
        producer.join(timeout_s)
    except ProducerStuck as e:
        if not at_end:
            raise ProducerStuck(f"rollback: {e}, and could take the prompts the rollback re-queues; "
                                f"resume the run with run.resume={run_dir}") from None
        log.warning("%s; the run ends without it", e)


def roll_back(error: LearnerRankDied, *, pools, rollouts, learner_lock: threading.Lock, run_dir: Path,
              restore: Callable[[Path | None], RunState], failed_at: int, detected_at: float,
              placement_timeout_s: float = 600.0) -> dict:
    """A learner rank died (at ``detected_at``, a perf_counter() time, while making step
    ``failed_at`` + 1) and the producer is stopped: a fresh buffer and ledger, new learner ranks,
    and ``restore`` (the driver's) back to the last checkpoint. Returns the rollback's record."""
    slot = pools.buffer_slot
    slot.replace(slot.id)  # rollouts of the abandoned steps must not be trained on
    rollouts.reset()
    with learner_lock:
        pools.learner.restart(placement_timeout_s)
    t_rebuilt = time.perf_counter()
    path = checkpoint.latest(run_dir)
    state = restore(path)
    record = {"rank": error.rank, "failed_at_step": failed_at, "resumed_at_step": state.step,
              "detected_at": detected_at, "rebuild_seconds": t_rebuilt - detected_at,
              "recovery_seconds": time.perf_counter() - detected_at}
    log.warning("learner recovered in %.1fs: back at step %d (version %d) from %s", record["recovery_seconds"],
                state.step, state.version, path or "the initial weights")
    return record

"""Async mode's admission control: the producer issues a batch only when it can still be
trained within ``buffer.max_staleness`` versions of the policy that samples it.

Without it the producer generates as far ahead as the buffer has room for, and the buffer
then drops what grew too old: on the default job with ``max_staleness=1``, three of every
four rollouts generated. Admission is by version, not by room: the next batch is trained
after every rollout already issued and not yet trained (in flight or in the buffer), one
step's worth per step, so it is issued only if its last rollout will be taken while the
policy is at most ``max_staleness`` versions newer than the one sampling it now. A learner
short of rollouts for its next take (prompts skipped, scores invalid) always gets one more
batch, so a loss never leaves it waiting.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

POLL_S = 0.5  # how often a waiting producer looks again (it is also woken by each take and push)


def admits(*, outstanding: int, per_step: int, max_staleness: int, taken_ahead: int) -> bool:
    """Whether another batch of ``per_step`` rollouts may be issued now.

    outstanding: rollouts issued and neither trained nor lost. taken_ahead: 1 while the
    learner trains on what it took at the current version (the next take is a version
    later), else 0.
    """
    if taken_ahead == 0 and outstanding < per_step:  # the next take is short: it must not wait forever
        return True
    return outstanding + per_step <= (max_staleness + 1 - taken_ahead) * per_step


class Admission:
    """The gate between async mode's producer and its next batch (``wait``); the driver says
    when the learner has taken its batch (``took``) and when the new version is out
    (``published``). ``outstanding()``: rollouts issued and neither trained nor lost."""

    def __init__(self, *, per_step: int, max_staleness: int, outstanding: Callable[[], int]) -> None:
        self.per_step, self.max_staleness, self._outstanding = per_step, max_staleness, outstanding
        self._changed, self._taken_ahead, self._waited_s = threading.Condition(), 0, 0.0

    def took(self) -> None:
        with self._changed:
            self._taken_ahead = 1
            self._changed.notify_all()

    def published(self) -> None:
        with self._changed:
            self._taken_ahead = 0
            self._changed.notify_all()

    def wait(self, stop: threading.Event, backlog: Callable[[], bool] = lambda: False) -> bool:
        """Block until the next batch is admitted (True), or there is ``backlog`` to generate
        first or ``stop`` is set (False). Chunks to generate again (requeued after a resume or
        a lost buffer) are already counted as outstanding: they must not wait behind the gate."""
        t0 = time.perf_counter()
        with self._changed:
            while not stop.is_set():
                if admits(outstanding=self._outstanding(), per_step=self.per_step,
                          max_staleness=self.max_staleness, taken_ahead=self._taken_ahead):
                    self._waited_s += time.perf_counter() - t0
                    return True
                if backlog():
                    break
                self._changed.wait(POLL_S)
        self._waited_s += time.perf_counter() - t0
        return False

    def pop_waited_seconds(self) -> float:
        """Seconds the producer waited at the gate since the last call (a step's metric)."""
        with self._changed:
            out, self._waited_s = self._waited_s, 0.0
        return out

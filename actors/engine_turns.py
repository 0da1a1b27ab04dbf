"""Who may use a generator's vLLM engine at a time: sampling or a weight update, never both.

A Generator actor takes weight pushes in their own Ray concurrency group, so a push
can arrive while a generate call runs in another thread. Sampling and updating must
not overlap (an in-process engine would run a forward while its weights are being
overwritten), so both go through ``EngineTurns``:

* A whole-call sampler (``sampling()`` around ``LLM.generate``) holds its turn for the
  whole call: a push waits for the call to end, as it always did.
* A stepping sampler (partial rollouts) takes one turn per engine step (``step()``), and
  a waiting update goes first at the next step boundary: the push waits for one engine
  step, not for the call. In-flight requests then go on under the new weights
  (actors/generator.py says how their KV and token versions are kept honest).

An update may span several calls (the NCCL transport's start/update/finish), so it is a
``claim()``/``release()`` pair as well as the ``updating()`` context.
"""
from __future__ import annotations

import contextlib
import threading


class EngineTurns:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = False          # a sampler step/call or an update holds the engine
        self._updates_waiting = 0   # updates go before the next sampler step
        self.updates_during_sampling = 0  # updates that landed between steps of a stepping call
        self._stepping = 0          # stepping calls in progress
        self.steps = 0              # engine steps taken by stepping calls, ever

    @property
    def busy(self) -> bool:
        """A sampler step or call, or an update, holds the engine now (a snapshot)."""
        return self._busy

    @property
    def updates_waiting(self) -> int:
        """Updates waiting for the engine now; they go before the next sampler step (a snapshot)."""
        return self._updates_waiting

    # ---- samplers
    @contextlib.contextmanager
    def sampling(self):
        """The engine for a whole call (updates wait until it ends)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._busy)
            self._busy = True
            self._cond.notify_all()  # for whoever watches the turn being taken
        try:
            yield
        finally:
            self._free()

    @contextlib.contextmanager
    def stepping_call(self):
        """Marks a call that takes one turn per engine step (so updates count as mid-call)."""
        with self._cond:
            self._stepping += 1
        try:
            yield
        finally:
            with self._cond:
                self._stepping -= 1

    @contextlib.contextmanager
    def step(self):
        """The engine for one step of a stepping call; a waiting update goes first."""
        with self._cond:
            self._cond.wait_for(lambda: not self._busy and self._updates_waiting == 0)
            self._busy = True
        try:
            yield
        finally:
            with self._cond:
                self.steps += 1
                self._busy = False
                self._cond.notify_all()

    # ---- updates
    def claim(self, *, after_steps: int = 0) -> None:
        """Wait for the engine (at most one step of a stepping call) and hold it.
        after_steps: not before ``steps`` reaches it (a test's way to land mid-call)."""
        with self._cond:
            self._cond.wait_for(lambda: self.steps >= after_steps)
            self._updates_waiting += 1
            try:
                self._cond.wait_for(lambda: not self._busy)
            finally:
                self._updates_waiting -= 1
            self._busy = True
            if self._stepping:
                self.updates_during_sampling += 1

    def release(self) -> None:
        self._free()

    @contextlib.contextmanager
    def updating(self):
        self.claim()
        try:
            yield
        finally:
            self.release()

    def _free(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()

"""A user's function called with a time limit that really stops the wait.

Python cannot interrupt a thread stuck in a sleep, a socket read or a C call, so a call past
its limit is not stopped: it is abandoned. The function runs in a daemon thread of its own;
the caller waits at most ``timeout_s`` for it and then goes on without it (the caller's
items are invalid). The abandoned thread keeps running until the function returns, and
whatever it returns then is dropped. At most ``max_abandoned`` of them are kept: beyond that
a call is refused at once (its items invalid too) until one of them returns, so a function
that hangs on every call costs a bounded number of threads, not one per call.

Why a thread and not a subprocess that could be killed: the function keeps running in the
process that imported it, as before, with its module state (a loaded model, a client, a
cache) kept between calls; its arguments and results need not be picklable; and no process
is restarted (with the user's imports) after each timeout. The price: an abandoned call may
still run while the next one starts, so a function with a time limit may be called
concurrently with itself.
"""
from __future__ import annotations

import threading
from typing import Any, Callable


class CallTimedOut(TimeoutError):
    """The call did not return within the limit; it goes on in an abandoned thread."""


class TooManyAbandoned(TimeoutError):
    """``max_abandoned`` earlier calls are still running past the limit; this one was not made."""


class TimedCall:
    """``fn(*args)`` in a daemon thread, waited for at most ``timeout_s`` seconds.

    Returns what ``fn`` returns and raises what it raises; raises CallTimedOut past the limit
    and TooManyAbandoned while ``max_abandoned`` abandoned calls still run.
    """

    def __init__(self, fn: Callable, timeout_s: float, max_abandoned: int = 4, name: str = "timed-call"):
        if timeout_s <= 0 or max_abandoned < 1:
            raise ValueError(f"TimedCall: timeout_s={timeout_s} must be > 0 and max_abandoned={max_abandoned} >= 1")
        self.fn, self.timeout_s, self.max_abandoned, self.name = fn, float(timeout_s), int(max_abandoned), name
        self._abandoned: list[threading.Thread] = []

    @property
    def abandoned(self) -> int:
        """Abandoned calls still running."""
        self._abandoned = [t for t in self._abandoned if t.is_alive()]
        return len(self._abandoned)

    def __call__(self, *args) -> Any:
        if self.abandoned >= self.max_abandoned:
            raise TooManyAbandoned(f"{self.abandoned} earlier calls are still running past the {self.timeout_s:g} s "
                                   "limit")
        box: dict = {}

        def target() -> None:
            try:
                box["value"] = self.fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the caller, as a direct call would raise it
                box["error"] = e

        thread = threading.Thread(target=target, name=self.name, daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            self._abandoned.append(thread)
            raise CallTimedOut(f"did not return within {self.timeout_s:g} s")
        if "error" in box:
            raise box["error"]
        return box["value"]

"""Async mode's producer thread: ProducerThread, and ProducerStuck when its stop is not heeded.

The step producer that runs it is cluster/runtime/loop/producers.py's AsyncProducer."""
from __future__ import annotations

import sys
import sysconfig
import threading
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.runtime.observe.produced import Produced

if TYPE_CHECKING:
    from cluster.runtime.loop.dispatch import ChunkDispatcher

SETTLE_S = 10.0  # how long a take waits for the produce() whose rollouts it consumed to return
# Python's and the installed libraries' files: not where a stuck producer's own code waits.
_LIBRARY_DIRS = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})


class ProducerThread:
    """Async mode: keeps generating and scoring with whatever weights the generators hold.

    ``admit(stop, backlog)`` waits until the next batch may be issued (cluster/runtime/loop/admission.py)
    or chunks wait to be generated again, ``issue()`` draws a batch, ``shaping()`` gives the current reward shaping.
    take() returns the accounting of everything produced since the previous take(), so
    each step reports the generation work done during it.
    """

    def __init__(self, rollouts: ChunkDispatcher, *, admit, issue, shaping) -> None:
        self._rollouts, self._admit, self._issue, self._shaping = rollouts, admit, issue, shaping
        self._stop = threading.Event()
        self._pending, self._lock, self._error = Produced(), threading.Lock(), None
        self._producing: frozenset = frozenset()  # ids of the chunks the running produce() issued
        self._returns = 0  # produce() calls returned so far
        self._produced = threading.Condition(self._lock)  # notified when a produce() returns
        self._thread = threading.Thread(target=self._loop, name="tether-producer", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                # A new batch once admitted; chunks to generate again (the backlog) at once either way.
                admitted = self._admit(self._stop, self._rollouts.has_backlog)
                if self._stop.is_set():
                    break
                chunks = self._issue() if admitted else []
                with self._lock:
                    self._producing = frozenset(c.id for c in chunks)
                produced = self._rollouts.produce(chunks, self._shaping(), stop=self._stop)
                with self._lock:
                    self._pending, self._producing = self._pending.merge(produced), frozenset()
                    self._returns += 1
                    self._produced.notify_all()
        except Exception as e:  # noqa: BLE001 - surfaced by take() in the main thread
            with self._lock:
                self._error = e
                self._produced.notify_all()

    def check(self) -> None:
        """Raise what ended the thread, if something did."""
        if self._error is not None:
            raise self._error

    def take(self, consumed_chunks=(), settle_s: float = SETTLE_S) -> Produced:
        """The accounting since the previous take. The buffer hands over a chunk's rollouts as soon
        as they are stored, a moment before the produce() that stored them returns its accounting;
        so a take that consumed every unfinished chunk of the running produce() waits for it to
        return (up to ``settle_s``: one still at work on a backlog reports with the next take)."""
        wanted = frozenset(consumed_chunks)
        with self._lock:
            unfinished = self._producing & {c.id for c in self._rollouts.ledger.in_flight()}
            if unfinished and unfinished <= wanted:
                returns = self._returns
                self._produced.wait_for(lambda: self._returns != returns or self._error is not None
                                        or self._stop.is_set(), timeout=settle_s)
            self.check()
            out, self._pending = self._pending, Produced()
        return out

    def stop(self) -> None:
        """Ask the thread to stop: it abandons what is in flight within rollouts.STOP_POLL_S, unless it
        is inside a call that does not look (starting a replacement replica, a health check)."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def alive(self) -> bool:
        """The thread still runs (a stopped one ends once its in-flight call returns)."""
        return self._thread.is_alive()

    def join(self, timeout_s: float = 60.0) -> None:
        """Wait for the thread to end; ProducerStuck if it still runs after ``timeout_s``."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise ProducerStuck(f"the rollout producer thread still runs {timeout_s:g}s after its stop "
                                f"(at {_where(self._thread)})")


class ProducerStuck(RuntimeError):
    """A stopped producer thread outlived the wait for it (the message is one line)."""


def _where(thread: threading.Thread) -> str:
    """``file:line function`` of the thread's innermost frame outside Python's and the libraries'
    files: the project's own code that waits."""
    frame = sys._current_frames().get(thread.ident)
    stack = traceback.extract_stack(frame) if frame is not None else []
    ours = [f for f in stack if not f.filename.startswith(_LIBRARY_DIRS)] or stack
    return f"{Path(ours[-1].filename).name}:{ours[-1].lineno} {ours[-1].name}" if ours else "an unknown place"

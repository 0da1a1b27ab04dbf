"""A pool of worker processes (core/infra/worker_process.py) that each run one request at a time.

``WorkerPool`` keeps the workers as slots. A slot's worker (worker_process.serve is its side)
starts, says "ready" (or why not) as its first message, then answers one request per message.
The pool starts workers, reads that first message, sends a request with its deadline, and waits
on all its workers at once: what comes back is a list of ``Event``s, a request's answer, its
time running out, or its worker's death. Its user decides what an event means and calls
``replace`` for a worker that timed out or died: the old one is SIGKILLed by its pid, a new one
started in its slot, not waited for (``handshake`` waits, for a user that wants a replacement
ready before it goes on; ``wait_once`` otherwise reads its first message along with the
answers). The pool counts timeouts, crashes (deaths mid-request) and restarts; the messages are
its user's: the reward sandbox (actors/rewards/sandbox.py) and the environment workers
(actors/environments/workers.py).
"""
from __future__ import annotations

import enum
import os
import time
from multiprocessing.connection import wait
from typing import Any, NamedTuple, Union

from core.infra.worker_process import how_it_died, kill, spawn, stop_all


class SlotState(enum.Enum):
    """Where a slot's worker is: starting, ready, or why it could not start."""
    STARTING = "starting"
    READY = "ready"
    REFUSED = "refused"  # its first message was an error (the slot's ``detail``: its reason)
    DIED = "died"        # it died before its first message (``detail``: how)
    LATE = "late"        # no first message within the pool's start_timeout_s


NOT_STARTED = (SlotState.REFUSED, SlotState.DIED, SlotState.LATE)  # a slot that will not serve


class Slot:
    """One worker process: its ``state`` and the request it runs (``job``, the user's note of it).
    A slot that could not start is killed and stays as it is."""

    def __init__(self, entry: str, args: list):
        self.proc, self.conn = spawn(entry, args)
        self.started = time.monotonic()
        self.state = SlotState.STARTING
        self.detail: str | None = None
        self.job: Any = None          # None: idle
        self.deadline = 0.0           # when the job runs out of time
        self.broken = False           # its job could not be sent: it is gone

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        kill(self.proc, self.conn)


class Answered(NamedTuple):
    """A slot's job was answered: ``reply`` is the worker's message."""
    slot: Slot
    job: Any
    reply: Any


class TimedOut(NamedTuple):
    """A slot's job was not answered within its time (the worker is still there: replace it)."""
    slot: Slot
    job: Any


class Died(NamedTuple):
    """A slot's worker died running its job (``how``: os._exit's status or the signal)."""
    slot: Slot
    job: Any
    how: str


Event = Union[Answered, TimedOut, Died]  # what ``wait_once`` saw of a slot's job


class WorkerPool:
    """Workers started as ``python -c entry`` with ``args`` and this process's pid last (what
    worker_process.serve takes as ``parent``), each given ``start_timeout_s`` to say it is ready."""

    def __init__(self, entry: str, args: list, *, start_timeout_s: float):
        self.entry, self.args = entry, [*args, os.getpid()]
        self.start_timeout_s = float(start_timeout_s)
        self.slots: list[Slot] = []
        self.counts = {"timeouts": 0, "crashes": 0, "restarts": 0}

    def add(self) -> Slot:
        """Start one more worker (in a new slot); it is "starting" until its first message is read."""
        slot = Slot(self.entry, self.args)
        self.slots.append(slot)
        return slot

    def alive(self) -> int:
        """Worker processes alive."""
        return sum(s.alive() for s in self.slots)

    def starting(self, slot: Slot) -> bool:
        """Whether a first message from ``slot`` is still awaited (its start time not yet over)."""
        return slot.state is SlotState.STARTING and time.monotonic() - slot.started < self.start_timeout_s

    def handshake(self, slot: Slot) -> bool:
        """Wait up to start_timeout_s for a starting worker's first message -> whether it is ready
        (if not, ``slot.state`` says why)."""
        if slot.conn.poll(self.start_timeout_s):
            self._first_message(slot)
        else:
            self._not_started(slot, SlotState.LATE)
        return slot.state is SlotState.READY

    def _first_message(self, slot: Slot) -> None:
        try:
            kind, text = slot.conn.recv()
        except (EOFError, OSError):  # it died importing: os._exit, a signal, its memory cap
            self._not_started(slot, SlotState.DIED, how_it_died(slot.proc))
            return
        if kind == "ready":
            slot.state = SlotState.READY
        else:
            self._not_started(slot, SlotState.REFUSED, text)

    @staticmethod
    def _not_started(slot: Slot, state: SlotState, detail: str | None = None) -> None:
        slot.state, slot.detail = state, detail
        slot.kill()

    def send(self, slot: Slot, message, job, timeout_s: float) -> None:
        """Send ``message`` to an idle ready worker as ``job``, to be answered within ``timeout_s``.
        A worker already gone is seen by the next ``wait_once`` as one that died."""
        slot.job = job
        try:
            slot.conn.send(message)
            slot.deadline = time.monotonic() + timeout_s
        except (BrokenPipeError, OSError):
            slot.broken = True

    def busy(self) -> bool:
        return any(s.job is not None for s in self.slots)

    def wait_once(self, wake: int | None = None) -> list[Event]:
        """Wait until a worker with a job or one starting sends something, the first deadline
        passes, or ``wake`` (a file descriptor; its user drains it) is readable; read what came
        (a first message updates its slot's state) -> the jobs' events. A starting worker past its
        start time is killed ("late")."""
        listening = [s for s in self.slots if s.job is not None or self.starting(s)]
        if not listening and wake is None:
            return []
        now = time.monotonic()
        deadline = min((0.0 if s.broken else s.deadline if s.job is not None else s.started + self.start_timeout_s
                        for s in listening), default=None)
        ready = wait([s.conn for s in listening] + ([] if wake is None else [wake]),
                     timeout=None if deadline is None else max(0.0, deadline - now))
        events = [self._read(s) for s in listening if s.conn in ready or s.broken]
        now = time.monotonic()
        for s in listening:
            if s.job is not None and now >= s.deadline:  # not read above: no answer in time
                self.counts["timeouts"] += 1
                events.append(TimedOut(s, s.job))
                s.job = None
            elif s.state is SlotState.STARTING and not self.starting(s):
                self._not_started(s, SlotState.LATE)
        return [e for e in events if e is not None]

    def _read(self, slot: Slot) -> Event | None:
        """Read what a slot sent: its first message (-> None), or its job's answer or death."""
        if slot.job is None:
            self._first_message(slot)
            return None
        job, slot.job = slot.job, None
        if not slot.broken:
            try:
                return Answered(slot, job, slot.conn.recv())
            except (EOFError, OSError):  # it died mid-request: os._exit, a signal, the OOM killer
                pass
        self.counts["crashes"] += 1
        return Died(slot, job, how_it_died(slot.proc))

    def replace(self, slot: Slot) -> Slot:
        """Kill the worker and start another in its slot (not waited for: see ``handshake``)."""
        slot.kill()
        new = Slot(self.entry, self.args)
        self.slots[self.slots.index(slot)] = new
        self.counts["restarts"] += 1
        return new

    def close(self) -> None:
        """Ask each worker to stop, then SIGKILL whatever has not, and reap them all."""
        stop_all(self.slots)
        self.slots = []

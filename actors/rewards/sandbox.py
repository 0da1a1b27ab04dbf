"""A reward function in worker processes: a pair that hangs, crashes or eats memory is invalid, not the replica.

``SandboxScorer`` (a TextScorer, actors/rewards/scoring.py) keeps ``workers`` processes, each of which
imports the function once (by its "module:function" spec) and then scores one (prompt,
response) pair per call: ``fn([p], [r], **{column: [value]})``. Per pair, because a verifier's
failures are per pair (one pathological answer hangs the parser), and a call of many pairs
would lose them all. The replica waits for each pair at most ``timeout_s``; past it the worker
is killed (SIGKILL, by its pid) and a new one started, so a hang costs one pair and one
process start. A worker that dies (os._exit, SIGSEGV, the OOM killer) costs its pair the
same way. ``memory_mb`` caps each worker's data segment (RLIMIT_DATA: the heap and anonymous
mappings, which is what a numpy array or a Python list grows; unlike RLIMIT_AS it does not
count address space that libraries reserve without using it): past it an allocation raises
MemoryError in the worker, and that pair is invalid.

Workers are fresh interpreters (core/infra/worker_process.py) that leave with the replica, kept
in a WorkerPool (core/infra/worker_pool.py): the waiting, killing and replacing are the pool's,
what a pair's outcome says is this module's. A replacement is not waited for; it takes pairs once ready.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from actors.rewards.scoring import ColumnBinding, Columns, ScoreResult, as_number, load_function
from core.infra.errors import type_and_first_line
from core.infra.worker_pool import NOT_STARTED, Answered, Event, Slot, SlotState, TimedOut, WorkerPool
from core.infra.worker_process import entry_args, serve

# How long a worker may take to start and import the function (a verifier imports sympy, a model...).
START_TIMEOUT_S = 120.0


def _one_score(out, name: str) -> tuple[float, str | None]:
    """A user's return for one pair: (score, None), or (NaN, a one-line reason)."""
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__") or not hasattr(out, "__iter__"):
        return float("nan"), f"{name} returned {type(out).__name__}, not a list of numbers"
    items = list(out)
    if len(items) != 1:
        return float("nan"), f"{name} returned {len(items)} scores for 1 pair"
    x = as_number(items[0])
    if np.isnan(x) and not isinstance(items[0], (float, np.floating)):
        return x, f"{name} returned {type(items[0]).__name__} instead of a number"
    if not np.isfinite(x):
        return float("nan"), f"{name} returned a non-finite score ({x})"
    return x, None


def _score(fn, binding: ColumnBinding, job: tuple, name: str, memory_mb: int) -> tuple[float, str | None]:
    """In a worker: one pair's (score, None), or (NaN, a one-line reason)."""
    prompt, response, columns = job  # columns: name -> [the pair's value]
    try:
        return _one_score(fn([prompt], [response], **binding.select(columns)), name)
    except MemoryError:
        return float("nan"), f"{name} ran out of memory (reward.sandbox.memory_mb={memory_mb})"
    except BaseException as e:  # noqa: BLE001 - user code, SystemExit included, costs its pair only
        return float("nan"), f"{name} raised {type_and_first_line(e)}"


def worker_main(conn, spec: str, key: str, name: str, memory_mb: int, parent: int) -> None:
    """One worker: import the function, say so, then score one pair per message until told to stop."""
    def load():
        fn = load_function(spec, key)
        binding = ColumnBinding.of(fn)
        return lambda job: _score(fn, binding, job, name, memory_mb)

    serve(conn, load, what=f"{key} {spec!r}", memory_mb=memory_mb, setting="reward.sandbox.memory_mb", parent=parent)


@dataclass
class _Call:
    """One score_texts call's outcome so far: a score per pair (NaN until one comes), and the problems."""
    scores: np.ndarray                                   # [N] float64
    problems: dict = field(default_factory=lambda: defaultdict(list))  # one-line reason -> pair indices
    timeouts: int = 0
    crashes: int = 0

    def failed(self, i: int, reason: str) -> None:
        self.problems[reason].append(i)


def _entry() -> None:
    """``python -c`` of a worker: its socket and its settings come as arguments."""
    conn, args = entry_args()
    worker_main(conn, *args)


class SandboxScorer:
    """``spec`` ("module:function") scored one pair per call in ``workers`` spawned processes,
    each call limited to ``timeout_s`` seconds and each worker to ``memory_mb`` MiB (0: no cap).

    The constructor starts the workers and waits until each has imported the function; one that
    cannot (not importable in a fresh process, over the memory cap) is a one-line ValueError.
    A worker replaced later is not waited for: it takes pairs once it is ready.
    """

    def __init__(self, spec: str, *, name: str, key: str, workers: int, timeout_s: float, memory_mb: int = 0):
        if workers < 1 or timeout_s <= 0 or memory_mb < 0:
            raise ValueError(f"SandboxScorer: workers={workers} must be >= 1, timeout_s={timeout_s} > 0 and "
                             f"memory_mb={memory_mb} >= 0")
        self.name, self.spec, self.key = name, spec, key
        self.timeout_s, self.memory_mb = float(timeout_s), int(memory_mb)
        self._lock = threading.Lock()
        self._pool = WorkerPool("from actors.rewards.sandbox import _entry; _entry()",
                                [spec, key, name, self.memory_mb], start_timeout_s=START_TIMEOUT_S)
        try:
            for _ in range(int(workers)):
                self._pool.add()
            for slot in self._pool.slots:  # all started at once, then each waited for
                if not self._pool.handshake(slot):
                    raise ValueError(self._start_error(slot, late="import it"))
        except BaseException:
            self.close()
            raise

    def _start_error(self, slot: Slot, late: str) -> str:
        """Why a worker could not start, in one line (``late``: what it did not do in time)."""
        if slot.state is SlotState.REFUSED:
            return slot.detail
        if slot.state is SlotState.LATE:
            return f"{self.name}: a reward.sandbox worker did not {late} within {START_TIMEOUT_S:g} s"
        return (f"{self.key} {self.spec!r}: a reward.sandbox worker {slot.detail} while importing it"
                + (f" (reward.sandbox.memory_mb={self.memory_mb}: raise it?)" if self.memory_mb else ""))

    @property
    def workers(self) -> int:
        """Worker processes alive."""
        return self._pool.alive()

    def score_texts(self, prompts: list[str], responses: list[str], columns: Columns) -> ScoreResult:
        n = len(prompts)
        call = _Call(np.full(n, np.nan, np.float64))
        with self._lock:
            self._run(list(prompts), list(responses), columns, call)
        valid = np.isfinite(call.scores)
        errors = [f"{reason} on {len(ix)} of {n} pairs (first at index {ix[0]}); those pairs are invalid"
                  for reason, ix in call.problems.items()]
        return ScoreResult(np.where(valid, call.scores, np.nan).astype(np.float32), valid, errors,
                           counts={"timeouts": call.timeouts, "crashes": call.crashes})

    def _run(self, prompts, responses, columns: Columns, call: _Call) -> None:
        """Hand the pairs out one at a time to idle workers until each has a score or a problem."""
        pool = self._pool
        pending = list(range(len(prompts)))[::-1]
        while pending or pool.busy():
            for slot in pool.slots:
                if slot.state is SlotState.READY and slot.job is None and pending:
                    i = pending.pop()
                    pool.send(slot, (prompts[i], responses[i], {k: [v[i]] for k, v in columns.items()}), i,
                              self.timeout_s)
            if pending and not any(s.state is SlotState.READY or pool.starting(s) for s in pool.slots):
                failed = next((s for s in pool.slots if s.state in NOT_STARTED), None)
                why = self._start_error(failed, late="start") if failed else "no worker could start"
                for i in pending:
                    call.failed(i, f"{self.name} not scored: {why}")
                return
            for event in pool.wait_once():
                self._record(event, call)

    def _record(self, event: Event, call: _Call) -> None:
        """A pair's score, or its problem; a worker that timed out or died is replaced."""
        i = event.job
        if isinstance(event, Answered):
            score, reason = event.reply
            call.scores[i] = score
            if reason:
                call.failed(i, reason)
            return
        if isinstance(event, TimedOut):
            call.timeouts += 1
            call.failed(i, f"{self.name} did not return within reward.sandbox.timeout_s={self.timeout_s:g} s "
                           "(its worker was killed)")
        else:
            call.crashes += 1
            call.failed(i, f"{self.name}: its worker process {event.how}")
        self._pool.replace(event.slot)

    def stats(self) -> dict:
        return {"abandoned_calls": 0, "sandbox_workers": self.workers, **self._pool.counts}

    def close(self) -> None:
        """Ask each worker to stop, then SIGKILL whatever has not, and reap them all."""
        self._pool.close()

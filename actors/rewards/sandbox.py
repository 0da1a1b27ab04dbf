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

Workers are fresh interpreters (core/infra/worker_process.py) that leave with the replica.
"""
from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from multiprocessing.connection import wait

import numpy as np

from actors.rewards.scoring import ColumnBinding, Columns, ScoreResult, as_number, load_function
from core.infra.errors import type_and_first_line
from core.infra.worker_process import entry_args, how_it_died, import_failure, kill, spawn, stop_all, worker_setup

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


def worker_main(conn, spec: str, key: str, name: str, memory_mb: int, parent: int) -> None:
    """One worker: import the function, say so, then score one pair per message until told to stop."""
    worker_setup(parent, memory_mb)
    try:
        fn = load_function(spec, key)
    except (ValueError, MemoryError) as e:
        why = str(e) if isinstance(e, ValueError) else f"{key} {spec!r}: MemoryError while importing it"
        text = import_failure(why, memory_mb, "reward.sandbox.memory_mb")
        try:
            conn.send(("error", text))
        except MemoryError:  # the parent reports the exit, naming memory_mb
            pass
        os._exit(1)
    binding = ColumnBinding.of(fn)
    conn.send(("ready", None))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        prompt, response, columns = job  # columns: name -> [the pair's value]
        try:
            result = _one_score(fn([prompt], [response], **binding.select(columns)), name)
        except MemoryError:
            result = float("nan"), f"{name} ran out of memory (reward.sandbox.memory_mb={memory_mb})"
        except BaseException as e:  # noqa: BLE001 - user code, SystemExit included, costs its pair only
            result = float("nan"), f"{name} raised {type_and_first_line(e)}"
        conn.send(result)


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


class _Worker:
    """One worker process and the pair it is scoring: (index, deadline) or None."""

    def __init__(self, spec: str, key: str, name: str, memory_mb: int):
        self.proc, self.conn = spawn("from actors.rewards.sandbox import _entry; _entry()",
                                     [spec, key, name, memory_mb, os.getpid()])
        self.ready = False
        self.error: str | None = None  # why it could not start
        self.started = time.monotonic()
        self.job: tuple[int, float] | None = None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        kill(self.proc, self.conn)

    def how_it_died(self) -> str:
        return how_it_died(self.proc)


class SandboxScorer:
    """``spec`` ("module:function") scored one pair per call in ``workers`` spawned processes,
    each call limited to ``timeout_s`` seconds and each worker to ``memory_mb`` MiB (0: no cap).

    The constructor starts the workers and waits until each has imported the function; one that
    cannot (not importable in a fresh process, over the memory cap) is a one-line ValueError.
    """

    def __init__(self, spec: str, *, name: str, key: str, workers: int, timeout_s: float, memory_mb: int = 0):
        if workers < 1 or timeout_s <= 0 or memory_mb < 0:
            raise ValueError(f"SandboxScorer: workers={workers} must be >= 1, timeout_s={timeout_s} > 0 and "
                             f"memory_mb={memory_mb} >= 0")
        self.name, self.spec, self.key = name, spec, key
        self.timeout_s, self.memory_mb = float(timeout_s), int(memory_mb)
        self._lock = threading.Lock()
        self._counts = {"timeouts": 0, "crashes": 0, "restarts": 0}
        self._workers = [self._start() for _ in range(int(workers))]
        try:
            self._await_ready()
        except BaseException:
            self.close()
            raise

    def _start(self) -> _Worker:
        return _Worker(self.spec, self.key, self.name, self.memory_mb)

    def _await_ready(self) -> None:
        """Wait for every worker's first message; a worker that fails to start is a ValueError."""
        for w in self._workers:
            if not w.conn.poll(START_TIMEOUT_S):
                raise ValueError(f"{self.name}: a reward.sandbox worker did not import it within "
                                 f"{START_TIMEOUT_S:g} s")
            self._started(w)
            if not w.ready:
                raise ValueError(w.error)

    def _started(self, w: _Worker) -> None:
        """Read a starting worker's first message: ready, or why not (kept in ``w.error``)."""
        try:
            kind, text = w.conn.recv()
        except (EOFError, OSError):
            kind, text = "error", (f"{self.key} {self.spec!r}: a reward.sandbox worker {w.how_it_died()} while "
                                   f"importing it" + (f" (reward.sandbox.memory_mb={self.memory_mb}: raise it?)"
                                                      if self.memory_mb else ""))
        w.ready = kind == "ready"
        w.error = text

    @property
    def workers(self) -> int:
        """Worker processes alive."""
        return sum(w.alive() for w in self._workers)

    def score_texts(self, prompts: list[str], responses: list[str], columns: Columns) -> ScoreResult:
        n = len(prompts)
        call = _Call(np.full(n, np.nan, np.float64))
        with self._lock:
            self._run(list(prompts), list(responses), columns, call)
            self._counts["timeouts"] += call.timeouts
            self._counts["crashes"] += call.crashes
        valid = np.isfinite(call.scores)
        errors = [f"{reason} on {len(ix)} of {n} pairs (first at index {ix[0]}); those pairs are invalid"
                  for reason, ix in call.problems.items()]
        return ScoreResult(np.where(valid, call.scores, np.nan).astype(np.float32), valid, errors,
                           counts={"timeouts": call.timeouts, "crashes": call.crashes})

    def _run(self, prompts, responses, columns: Columns, call: _Call) -> None:
        """Hand the pairs out one at a time to idle workers until each has a score or a problem."""
        pending = list(range(len(prompts)))[::-1]
        while pending or any(w.job for w in self._workers):
            for w in self._workers:
                if w.ready and w.job is None and pending:
                    i = pending.pop()
                    try:
                        w.conn.send((prompts[i], responses[i], {k: [v[i]] for k, v in columns.items()}))
                        w.job = (i, time.monotonic() + self.timeout_s)
                    except (BrokenPipeError, OSError):
                        call.crashes += 1
                        call.failed(i, f"{self.name}: its worker process {w.how_it_died()}")
                        self._replace(w)
            if pending and not any(w.ready or self._starting(w) for w in self._workers):
                why = next((w.error for w in self._workers if w.error), "no worker could start")
                for i in pending:
                    call.failed(i, f"{self.name} not scored: {why}")
                return
            self._wait_once(call)

    def _starting(self, w: _Worker) -> bool:
        return not w.ready and w.error is None and time.monotonic() - w.started < START_TIMEOUT_S

    def _wait_once(self, call: _Call) -> None:
        """Wait for the next message or deadline; record what came, kill what ran out of time."""
        now = time.monotonic()
        deadlines = [w.job[1] for w in self._workers if w.job] + \
                    [w.started + START_TIMEOUT_S for w in self._workers if self._starting(w)]
        listening = [w for w in self._workers if w.job or self._starting(w)]
        ready = wait([w.conn for w in listening], timeout=max(0.0, min(deadlines, default=now) - now))
        for w in listening:
            if w.conn in ready:
                self._receive(w, call)
        now = time.monotonic()
        for w in list(self._workers):
            if w.job and now >= w.job[1]:
                call.timeouts += 1
                call.failed(w.job[0], f"{self.name} did not return within reward.sandbox.timeout_s="
                                      f"{self.timeout_s:g} s (its worker was killed)")
                self._replace(w)
            elif not w.ready and w.error is None and not self._starting(w):
                w.error = f"{self.name}: a reward.sandbox worker did not start within {START_TIMEOUT_S:g} s"
                w.kill()

    def _receive(self, w: _Worker, call: _Call) -> None:
        if not w.ready:
            self._started(w)
            return
        i, _ = w.job
        try:
            score, reason = w.conn.recv()
        except (EOFError, OSError):  # it died mid-pair: os._exit, a signal, the OOM killer
            call.crashes += 1
            call.failed(i, f"{self.name}: its worker process {w.how_it_died()}")
            self._replace(w)
            return
        w.job = None
        call.scores[i] = score
        if reason:
            call.failed(i, reason)

    def _replace(self, w: _Worker) -> None:
        """Kill the worker and start another in its slot."""
        w.kill()
        self._workers[self._workers.index(w)] = self._start()
        self._counts["restarts"] += 1

    def stats(self) -> dict:
        return {"abandoned_calls": 0, "sandbox_workers": self.workers, **self._counts}

    def close(self) -> None:
        """Ask each worker to stop, then SIGKILL whatever has not, and reap them all."""
        stop_all(self._workers)
        self._workers = []

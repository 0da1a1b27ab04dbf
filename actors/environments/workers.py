"""Environments in worker processes: a crash or a hang ends episodes, never the generator.

``EnvironmentWorkers`` keeps ``workers`` processes (core/infra/worker_process.py). Each imports the
environment class once (actors/environments/base.py) and holds the instances of the episodes given
to it, one instance per episode, by the episode's id. ``call`` runs one round of requests:
``("reset", prompt, columns)`` starts an episode, ``("step", action)`` and ``("close",)`` go to
a running one. One worker's requests run one after another, the workers side by side, and
each request waits at most ``step_timeout_s``.

Each answer is an ``Outcome``: the checked result, or why the episode ended invalid. The
user's code raised or returned something invalid (``error``; counted as ``malformed_actions``
when ``step`` raised actors.environments.base.MalformedAction, else ``errors``); the request passed its time
limit (``timed_out``: the worker is killed by its pid and a new one started); the worker died
(``crashed``). A worker killed or dead takes the other episodes it held with it: their next
request is answered ``lost``. Nothing the environment does raises here.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Optional

from actors.environments.base import InvalidStep, MalformedAction, check_observation, check_step, load_environment
from core.infra.errors import type_and_first_line
from core.infra.worker_process import entry_args, how_it_died, import_failure, kill, spawn, stop_all, worker_setup

START_TIMEOUT_S = 120.0  # a worker's start and its import of the class


@dataclass
class Outcome:
    """One request's answer: ``result`` (reset: the first observation or None; step: a Step;
    close: None), or ``error``, a one-line reason the episode ended invalid."""
    result: Any = None
    error: Optional[str] = None
    timed_out: bool = False
    crashed: bool = False
    lost: bool = False  # its worker was killed or died while another episode's request ran

    @property
    def ok(self) -> bool:
        return self.error is None


def _answer(envs: dict, cls: type, name: str, episode: int, op: str, payload) -> tuple[str, Any]:
    """Run one request in the worker -> ("ok", result) or ("error", a one-line reason)."""
    try:
        if op == "reset":
            envs[episode] = cls()
            return "ok", check_observation(envs[episode].reset(*payload), f"{name}.reset")
        if op == "step":
            return "ok", check_step(envs[episode].step(payload), f"{name}.step")
        envs.pop(episode, None)
        return "ok", None
    except BaseException as e:  # noqa: BLE001 - user code, SystemExit included, costs its episode only
        envs.pop(episode, None)
        if isinstance(e, MalformedAction):
            return "malformed", str(e)
        return "error", str(e) if isinstance(e, InvalidStep) else f"{name}.{op} raised {type_and_first_line(e)}"


def worker_main(conn, spec: str, key: str, memory_mb: int, parent: int) -> None:
    """One worker: import the class, say so, then answer one request per message until told to stop."""
    worker_setup(parent, memory_mb)
    try:
        cls = load_environment(spec, key)
    except (ValueError, MemoryError) as e:
        why = str(e) if isinstance(e, ValueError) else f"{key} {spec!r}: MemoryError while importing it"
        conn.send(("error", import_failure(why, memory_mb, "env.memory_mb")))
        os._exit(1)
    conn.send(("ready", None))
    envs: dict = {}
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request is None:
            return
        answer = _answer(envs, cls, f"environment {spec}", *request)
        try:
            conn.send(answer)
        except Exception as e:  # noqa: BLE001 - an info dict that does not pickle
            envs.pop(request[0], None)
            conn.send(("error", f"environment {spec}: its {request[1]} result cannot be sent "
                                f"({type_and_first_line(e)}); return plain str, numbers and dicts"))


def _entry() -> None:
    conn, args = entry_args()
    worker_main(conn, *args)


class _Worker:
    def __init__(self, spec: str, key: str, memory_mb: int):
        self.proc, self.conn = spawn("from actors.environments.workers import _entry; _entry()",
                                     [spec, key, memory_mb, os.getpid()])
        self.queue: list[tuple] = []          # (episode, op, payload) still to send this round
        self.job: Optional[tuple] = None      # (episode, op, deadline) of the request it is running

    def ready(self) -> None:
        """Wait for its first message; -> nothing, or a ValueError saying why it could not start."""
        if not self.conn.poll(START_TIMEOUT_S):
            raise ValueError(f"an environment worker did not start within {START_TIMEOUT_S:g} s")
        try:
            kind, text = self.conn.recv()
        except (EOFError, OSError):
            kind, text = "error", f"an environment worker {how_it_died(self.proc)} while importing the class"
        if kind != "ready":
            raise ValueError(text)


class EnvironmentWorkers:
    """``spec`` ("module:Class") in ``workers`` processes; see the module's docstring.

    The constructor starts the workers and waits until each has imported the class; one that
    cannot is a one-line ValueError naming ``key``."""

    def __init__(self, spec: str, *, key: str = "env.class", workers: int, step_timeout_s: float,
                 memory_mb: int = 0):
        if workers < 1 or step_timeout_s <= 0 or memory_mb < 0:
            raise ValueError(f"EnvironmentWorkers: workers={workers} must be >= 1, step_timeout_s={step_timeout_s} "
                             f"> 0 and memory_mb={memory_mb} >= 0")
        self.spec, self.key, self.memory_mb = spec, key, int(memory_mb)
        self.step_timeout_s = float(step_timeout_s)
        self.counts = {"timeouts": 0, "crashes": 0, "errors": 0, "malformed_actions": 0, "lost": 0, "restarts": 0}
        self._home: dict[int, _Worker] = {}  # running episode -> the worker holding its instance
        self._lost: dict[int, str] = {}      # episode -> why its worker is gone
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        try:
            for _ in range(int(workers)):
                self._workers.append(self._start())
        except BaseException:
            self.close()
            raise

    def _start(self) -> _Worker:
        w = _Worker(self.spec, self.key, self.memory_mb)
        try:
            w.ready()
        except ValueError as e:
            kill(w.proc, w.conn)
            raise ValueError(f"{self.key} {self.spec!r}: {e}" if self.spec not in str(e) else str(e)) from None
        return w

    @property
    def running(self) -> int:
        """Episodes held by the workers."""
        return len(self._home)

    def call(self, requests: dict[int, tuple]) -> dict[int, Outcome]:
        """One round: episode id -> ("reset", prompt, columns) | ("step", action) | ("close",);
        -> episode id -> Outcome, for every request."""
        with self._lock:
            out: dict[int, Outcome] = {}
            for episode, (op, *payload) in requests.items():
                self._route(episode, op, payload[0] if op == "step" else tuple(payload), out)
            while any(w.queue or w.job for w in self._workers):
                for w in self._workers:
                    if w.job is None and w.queue:
                        self._send(w, out)
                self._wait_once(out)
            return out

    def _route(self, episode: int, op: str, payload, out: dict) -> None:
        if op == "reset":
            self._lost.pop(episode, None)
            w = min(self._workers, key=lambda x: sum(h is x for h in self._home.values()))
            self._home[episode] = w
        elif episode in self._lost:
            why = self._lost.pop(episode)
            if op == "close":  # nothing to close, and nothing lost that its episode still needed
                out[episode] = Outcome()
                return
            self.counts["lost"] += 1
            out[episode] = Outcome(error=why, lost=True)
            return
        elif episode not in self._home:
            out[episode] = Outcome(error=f"environment {self.spec}: episode {episode} is not running")
            return
        self._home[episode].queue.append((episode, op, payload))

    def _send(self, w: _Worker, out: dict) -> None:
        request = w.queue.pop(0)
        try:
            w.conn.send(request)
            w.job = (*request[:2], time.monotonic() + self.step_timeout_s)
        except (BrokenPipeError, OSError):
            w.job = (*request[:2], 0.0)
            self._gone(w, out, f"its worker process {how_it_died(w.proc)}", crashed=True)

    def _wait_once(self, out: dict) -> None:
        busy = [w for w in self._workers if w.job]
        now = time.monotonic()
        ready = wait([w.conn for w in busy], timeout=max(0.0, min(w.job[2] for w in busy) - now)) if busy else []
        for w in busy:
            if w.conn in ready:
                self._receive(w, out)
            elif time.monotonic() >= w.job[2]:
                self._gone(w, out, f"did not answer within env.step_timeout_s={self.step_timeout_s:g} s (its worker "
                                   "was killed)", timed_out=True)

    def _receive(self, w: _Worker, out: dict) -> None:
        episode, op, _ = w.job
        try:
            status, result = w.conn.recv()
        except (EOFError, OSError):  # it died mid-request: os._exit, a signal, the OOM killer
            self._gone(w, out, f"its worker process {how_it_died(w.proc)}", crashed=True)
            return
        w.job = None
        out[episode] = Outcome(result=result) if status == "ok" else Outcome(error=result)
        if status != "ok":
            self.counts["malformed_actions" if status == "malformed" else "errors"] += 1
        if status != "ok" or op == "close":  # the worker dropped the instance
            self._home.pop(episode, None)

    def _gone(self, w: _Worker, out: dict, reason: str, *, timed_out: bool = False, crashed: bool = False) -> None:
        """The worker is killed or dead: its request ends its episode, the others it held are lost."""
        episode = w.job[0]
        self.counts["timeouts" if timed_out else "crashes"] += 1
        out[episode] = Outcome(error=f"environment {self.spec} {reason}", timed_out=timed_out, crashed=crashed)
        for other in [e for e, h in self._home.items() if h is w]:
            self._home.pop(other)
            if other != episode:
                self._lost[other] = f"environment {self.spec}: lost with its worker, which {reason}"
        for other, _, _ in w.queue:  # this round's requests it had not sent yet
            if other not in out:
                self.counts["lost"] += 1
                out[other] = Outcome(error=self._lost.pop(other), lost=True)
        kill(w.proc, w.conn)
        self._workers[self._workers.index(w)] = self._start()
        self.counts["restarts"] += 1

    def stats(self) -> dict:
        return {"env_workers": sum(w.proc.poll() is None for w in self._workers), "episodes_running": self.running,
                **self.counts}

    def close(self) -> None:
        """Ask each worker to stop, then SIGKILL whatever has not, and reap them all."""
        stop_all(self._workers)
        self._workers, self._home = [], {}

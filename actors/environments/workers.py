"""Environments in worker processes: a crash or a hang ends episodes, never the generator.

``EnvironmentWorkers`` keeps ``workers`` processes (a WorkerPool, core/infra/worker_pool.py). Each
imports the environment class once (actors/environments/base.py) and holds the instances of the
episodes given to it, one instance per episode, by the episode's id. ``call`` runs one round of requests:
``("reset", prompt, columns)`` starts an episode, ``("step", action)`` and ``("close",)`` go to
a running one. One worker's requests run one after another, the workers side by side, and
each request waits at most ``step_timeout_s``. ``submit`` and ``poll`` are the same without the
round: requests join the queues whenever they come, and each poll returns what has been
answered (episodes at their own pace: actors/environments/continuous.py).

Each answer is an ``Outcome``: the checked result, or why the episode ended invalid. The
user's code raised or returned something invalid (``error``; counted as ``malformed_actions``
when ``step`` raised actors.environments.base.MalformedAction, else ``errors``); the request passed its time
limit (``timed_out``: the worker is killed by its pid and a new one started); the worker died
(``crashed``). A worker killed or dead takes the other episodes it held with it: their next
request is answered ``lost``. Nothing the environment does raises here.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Optional

from actors.environments.base import InvalidStep, MalformedAction, check_observation, check_step, load_environment
from core.infra.errors import type_and_first_line
from core.infra.worker_pool import Died, Event, Slot, SlotState, TimedOut, WorkerPool
from core.infra.worker_process import entry_args, serve

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
    envs: dict = {}  # episode id -> its instance
    name = f"environment {spec}"

    def load():
        cls = load_environment(spec, key)
        return lambda request: _answer(envs, cls, name, *request)

    def unsendable(request, e: Exception) -> tuple[str, str]:  # an info dict that does not pickle
        envs.pop(request[0], None)
        return "error", (f"{name}: its {request[1]} result cannot be sent ({type_and_first_line(e)}); return plain "
                         "str, numbers and dicts")

    serve(conn, load, what=f"{key} {spec!r}", memory_mb=memory_mb, setting="env.memory_mb", parent=parent,
          unsendable=unsendable)


def _entry() -> None:
    conn, args = entry_args()
    worker_main(conn, *args)


class EnvironmentWorkers:
    """``spec`` ("module:Class") in ``workers`` processes; see the module's docstring.

    The constructor starts the workers and waits until each has imported the class; one that
    cannot is a one-line ValueError naming ``key``. So is a replacement that cannot, from ``call``."""

    def __init__(self, spec: str, *, key: str = "env.class", workers: int, step_timeout_s: float,
                 memory_mb: int = 0):
        if workers < 1 or step_timeout_s <= 0 or memory_mb < 0:
            raise ValueError(f"EnvironmentWorkers: workers={workers} must be >= 1, step_timeout_s={step_timeout_s} "
                             f"> 0 and memory_mb={memory_mb} >= 0")
        self.spec, self.key, self.memory_mb = spec, key, int(memory_mb)
        self.step_timeout_s = float(step_timeout_s)
        self._faults = {"errors": 0, "malformed_actions": 0, "lost": 0}  # the pool counts the rest
        self._home: dict[int, Slot] = {}  # running episode -> the worker holding its instance
        self._lost: dict[int, str] = {}   # episode -> why its worker is gone
        self._queues: dict[Slot, list] = {}  # worker -> (episode, op, payload) not yet sent to it
        self._lock = threading.RLock()
        self._pool = WorkerPool("from actors.environments.workers import _entry; _entry()",
                                [spec, key, self.memory_mb], start_timeout_s=START_TIMEOUT_S)
        try:
            for _ in range(int(workers)):  # one at a time, each waited for
                self._ready(self._pool.add())
        except BaseException:
            self.close()
            raise

    def _ready(self, slot: Slot) -> None:
        """Wait for a new worker's first message; one that cannot start is a ValueError saying why."""
        if self._pool.handshake(slot):
            return
        why = {SlotState.REFUSED: slot.detail,
               SlotState.DIED: f"an environment worker {slot.detail} while importing the class",
               SlotState.LATE: f"an environment worker did not start within {START_TIMEOUT_S:g} s"}[slot.state]
        raise ValueError(f"{self.key} {self.spec!r}: {why}" if self.spec not in why else why)

    @property
    def running(self) -> int:
        """Episodes held by the workers."""
        return len(self._home)

    @property
    def counts(self) -> dict:
        """The faults so far, by kind, and the workers restarted."""
        pool = self._pool.counts
        return {"timeouts": pool["timeouts"], "crashes": pool["crashes"], **self._faults,
                "restarts": pool["restarts"]}

    def call(self, requests: dict[int, tuple]) -> dict[int, Outcome]:
        """One round: episode id -> ("reset", prompt, columns) | ("step", action) | ("close",);
        -> episode id -> Outcome, for every request."""
        with self._lock:
            out = self.submit(requests)
            while self.pending:
                out.update(self.poll())
            return out

    def submit(self, requests: dict[int, tuple]) -> dict[int, Outcome]:
        """Queue requests (as ``call`` takes them) behind those already queued -> the ones answered
        at once (an episode lost with its worker, or not running); ``poll`` answers the rest."""
        with self._lock:
            out: dict[int, Outcome] = {}
            for episode, (op, *payload) in requests.items():
                self._route(episode, op, payload[0] if op == "step" else tuple(payload), self._queues, out)
            return out

    @property
    def pending(self) -> int:
        """Requests queued or running."""
        return sum(map(len, self._queues.values())) + sum(s.job is not None for s in self._pool.slots)

    def poll(self, wake=None) -> dict[int, Outcome]:
        """Send queued requests to idle workers, then wait until one answers, dies or runs out of
        time, or ``wake`` (a readable file descriptor) is -> the Outcomes that came."""
        with self._lock:
            out: dict[int, Outcome] = {}
            for slot, queue in self._queues.items():
                if slot.job is None and queue:
                    request = queue.pop(0)
                    self._pool.send(slot, request, request[:2], self.step_timeout_s)
            for event in self._pool.wait_once(wake):
                self._record(event, self._queues, out)
            return out

    def _route(self, episode: int, op: str, payload, queues: dict, out: dict) -> None:
        if op == "reset":
            self._lost.pop(episode, None)
            self._home[episode] = min(self._pool.slots, key=lambda x: sum(h is x for h in self._home.values()))
        elif episode in self._lost:
            why = self._lost.pop(episode)
            if op == "close":  # nothing to close, and nothing lost that its episode still needed
                out[episode] = Outcome()
                return
            self._faults["lost"] += 1
            out[episode] = Outcome(error=why, lost=True)
            return
        elif episode not in self._home:
            out[episode] = Outcome(error=f"environment {self.spec}: episode {episode} is not running")
            return
        queues.setdefault(self._home[episode], []).append((episode, op, payload))

    def _record(self, event: Event, queues: dict, out: dict) -> None:
        episode, op = event.job
        if isinstance(event, TimedOut):
            self._gone(event, queues, out, f"did not answer within env.step_timeout_s={self.step_timeout_s:g} s "
                                           "(its worker was killed)", timed_out=True)
            return
        if isinstance(event, Died):
            self._gone(event, queues, out, f"its worker process {event.how}", crashed=True)
            return
        status, result = event.reply
        out[episode] = Outcome(result=result) if status == "ok" else Outcome(error=result)
        if status != "ok":
            self._faults["malformed_actions" if status == "malformed" else "errors"] += 1
        if status != "ok" or op == "close":  # the worker dropped the instance
            self._home.pop(episode, None)

    def _gone(self, event: Event, queues: dict, out: dict, reason: str, *, timed_out: bool = False,
              crashed: bool = False) -> None:
        """The worker is killed or dead: its request ends its episode, the others it held are lost."""
        w, episode = event.slot, event.job[0]
        out[episode] = Outcome(error=f"environment {self.spec} {reason}", timed_out=timed_out, crashed=crashed)
        for other in [e for e, h in self._home.items() if h is w]:
            self._home.pop(other)
            if other != episode:
                self._lost[other] = f"environment {self.spec}: lost with its worker, which {reason}"
        for other, _, _ in queues.pop(w, []):  # the requests it had not been sent yet
            if other not in out:
                self._faults["lost"] += 1
                out[other] = Outcome(error=self._lost.pop(other), lost=True)
        self._ready(self._pool.replace(w))

    def stats(self) -> dict:
        return {"env_workers": self._pool.alive(), "episodes_running": self.running, **self.counts}

    def close(self) -> None:
        """Ask each worker to stop, then SIGKILL whatever has not, and reap them all."""
        self._pool.close()
        self._home, self._queues = {}, {}

"""Agents in worker processes: the user's agent program plays one episode per request, through its session.

An agent is a plain function (or an ``async def``), named by ``"module:function"`` as a reward
function is, called once per episode::

    def agent(prompt: str, columns: dict, *, client, base_url: str) -> float | None:
        # talk to the policy through ``client`` (an openai.OpenAI on the session's URL; an
        # openai.AsyncOpenAI for an async agent), or any OpenAI-compatible library pointed at
        # ``base_url``, as often as it likes; -> the episode's score, or None: the score is
        # left to the reward pool, on the final transcript
        ...

It is given only the keywords it names (``client``, ``base_url``; both with ``**kwargs``).
Each worker process imports the function once and plays one episode at a time, within
``episode_timeout_s`` and ``memory_mb``. An agent that raises, returns something other than
a finite number or None, passes its time (its worker is SIGKILLed by its pid and replaced)
or dies ends its episode invalid, with a one-line reason; the run goes on.
"""
from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Optional

from actors.rewards.scoring import load_function
from core.infra.errors import type_and_first_line
from core.infra.worker_pool import Answered, Died, SlotState, TimedOut, WorkerPool
from core.infra.worker_process import entry_args, serve

START_TIMEOUT_S = 120.0  # a worker's start and its import of the agent
API_KEY = "tether"  # the gateway checks none; the OpenAI client insists on one


@dataclass
class AgentOutcome:
    """One episode's end: the agent's ``score`` (None: left to the reward pool), or ``error``,
    a one-line reason the episode is invalid."""
    score: Optional[float] = None
    error: Optional[str] = None
    timed_out: bool = False
    crashed: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None


def check_score(out, name: str) -> Optional[float]:
    if out is None:
        return None
    if isinstance(out, bool) or not isinstance(out, numbers.Real) or not math.isfinite(float(out)):
        raise ValueError(f"{name} returned {out!r}; return a finite number (the episode's score) or None")
    return float(out)


class Keywords:
    """The keywords an agent names among ``client`` and ``base_url`` (both for ``**kwargs``), made
    per episode. The OpenAI client is imported when the worker starts, not in its first episode,
    and a plain agent's clients share one pool of HTTP connections to the gateway."""

    def __init__(self, fn) -> None:
        params = inspect.signature(fn).parameters
        anything = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        self.url, self.client = anything or "base_url" in params, anything or "client" in params
        self.is_async = inspect.iscoroutinefunction(fn)
        self._http = None
        if self.client:
            import httpx
            import openai  # noqa: F401 - imported here, at the worker's start

            # The session's URL is the cluster's own: never through a proxy the environment names.
            self._http = None if self.is_async else httpx.Client(trust_env=False)

    def __call__(self, base_url: str) -> dict:
        out = {"base_url": base_url} if self.url else {}
        if self.client:
            import httpx
            import openai

            if self.is_async:  # a client of its own: each episode runs in an event loop of its own
                out["client"] = openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0,
                                                   http_client=httpx.AsyncClient(trust_env=False))
            else:
                out["client"] = openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0,
                                              http_client=self._http)
        return out


def play(fn, keywords: Keywords, name: str, request: tuple) -> tuple[str, object]:
    """One episode in the worker -> ("ok", score) or ("error", a one-line reason)."""
    base_url, prompt, columns = request
    try:
        kwargs = keywords(base_url)
        out = asyncio.run(fn(prompt, columns, **kwargs)) if keywords.is_async else fn(prompt, columns, **kwargs)
    except BaseException as e:  # noqa: BLE001 - user code, SystemExit included, costs its episode only
        return "error", f"{name} raised {type_and_first_line(e)}"
    try:
        return "ok", check_score(out, name)
    except ValueError as e:
        return "error", str(e)


def worker_main(conn, spec: str, key: str, memory_mb: int, parent: int) -> None:
    name = f"agent {spec}"

    def load():
        fn = load_function(spec, key)
        keywords = Keywords(fn)
        return lambda request: play(fn, keywords, name, request)

    serve(conn, load, what=f"{key} {spec!r}", memory_mb=memory_mb, setting="env.memory_mb", parent=parent)


def _entry() -> None:
    conn, args = entry_args()
    worker_main(conn, *args)


class AgentWorkers:
    """``spec`` in ``workers`` processes; the constructor waits until each has imported it (one
    that cannot is a one-line ValueError naming ``key``)."""

    def __init__(self, spec: str, *, key: str = "env.agent", workers: int, episode_timeout_s: float,
                 memory_mb: int = 0) -> None:
        if workers < 1 or episode_timeout_s <= 0 or memory_mb < 0:
            raise ValueError(f"AgentWorkers: workers={workers} must be >= 1, episode_timeout_s={episode_timeout_s} "
                             f"> 0 and memory_mb={memory_mb} >= 0")
        self.spec, self.key, self.timeout_s = spec, key, float(episode_timeout_s)
        self.errors = 0
        self._pool = WorkerPool("from actors.gateway.agents import _entry; _entry()", [spec, key, int(memory_mb)],
                                start_timeout_s=START_TIMEOUT_S)
        try:
            for _ in range(int(workers)):
                self._ready(self._pool.add())
        except BaseException:
            self.close()
            raise

    def _ready(self, slot) -> None:
        if self._pool.handshake(slot):
            return
        why = {SlotState.REFUSED: slot.detail,
               SlotState.DIED: f"an agent worker {slot.detail} while importing the agent",
               SlotState.LATE: f"an agent worker did not start within {START_TIMEOUT_S:g} s"}[slot.state]
        raise ValueError(why if self.spec in why else f"{self.key} {self.spec!r}: {why}")

    @property
    def counts(self) -> dict:
        """Episodes that ended invalid, by why, and the workers restarted."""
        pool = self._pool.counts
        return {"errors": self.errors, "timeouts": pool["timeouts"], "crashes": pool["crashes"],
                "restarts": pool["restarts"]}

    def stats(self) -> dict:
        return {"agent_workers": self._pool.alive(), **self.counts}

    def run(self, episodes: dict[int, tuple[str, str, dict]]) -> dict[int, AgentOutcome]:
        """episode id -> (its session's base URL, the prompt's text, its row's columns); every
        episode played, ``workers`` at a time -> episode id -> AgentOutcome."""
        todo, out = list(episodes.items()), {}
        while todo or self._pool.busy():
            for slot in self._pool.slots:
                if todo and slot.job is None and not slot.broken:
                    episode, request = todo.pop(0)
                    self._pool.send(slot, request, episode, self.timeout_s)
            for event in self._pool.wait_once():
                out[event.job] = self._outcome(event)
        return out

    def _outcome(self, event) -> AgentOutcome:
        if isinstance(event, Answered):
            status, result = event.reply
            if status == "ok":
                return AgentOutcome(score=result)
            self.errors += 1
            return AgentOutcome(error=result)
        self._ready(self._pool.replace(event.slot))
        if isinstance(event, TimedOut):
            return AgentOutcome(error=f"agent {self.spec} did not finish its episode within env.episode_timeout_s="
                                      f"{self.timeout_s:g} s (its worker was killed)", timed_out=True)
        assert isinstance(event, Died)
        return AgentOutcome(error=f"agent {self.spec}: its worker process {event.how}", crashed=True)

    def close(self) -> None:
        self._pool.close()

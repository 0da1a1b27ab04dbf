"""Agents in worker processes: the user's agent program plays each episode through its session.

An agent is a plain function (or an ``async def``), named by ``"module:function"`` as a reward
function is, called once per episode::

    def agent(prompt: str, columns: dict, *, client, base_url: str) -> float | None:
        # talk to the policy through ``client`` (an openai.OpenAI on the session's URL; an
        # openai.AsyncOpenAI for an async agent), or any OpenAI-compatible library pointed at
        # ``base_url``, as often as it likes; -> the episode's score, or None: the score is
        # left to the reward pool, on the final transcript
        ...

It is given only the keywords it names (``client``, ``base_url``; both with ``**kwargs``).
Each worker process imports the function once and plays up to ``per_worker`` episodes at once
(an async agent's as tasks of one event loop, a plain one's in threads), within ``memory_mb``,
each episode within ``episode_timeout_s``. An agent that raises, returns something other than
a finite number or None, or passes its time ends its episode invalid, with a one-line reason;
the run goes on. A plain episode past its time cannot be stopped in its thread, so its worker
is SIGKILLed by its pid and replaced once the others are answered; a worker that dies (or
is stuck past its episodes' time) ends the episodes it held.
"""
from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Optional

from actors.rewards.scoring import load_function
from core.infra.errors import type_and_first_line
from core.infra.worker_pool import Answered, Died, SlotState, TimedOut, WorkerPool
from core.infra.worker_process import entry_args, serve

START_TIMEOUT_S = 120.0  # a worker's start and its import of the agent
STUCK_GRACE_S = 30.0  # past its episodes' time, a worker that has not answered (stuck in C, say) is killed
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
    """One plain agent's episode -> ("ok", score) or ("error", a one-line reason)."""
    base_url, prompt, columns = request
    try:
        out = fn(prompt, columns, **keywords(base_url))
    except BaseException as e:  # noqa: BLE001 - user code, SystemExit included, costs its episode only
        return "error", f"{name} raised {type_and_first_line(e)}"
    return scored(out, name)


async def play_async(fn, keywords: Keywords, name: str, request: tuple, timeout_s: float) -> tuple[str, object]:
    """One async agent's episode, within ``timeout_s`` (then cancelled) -> as ``play``, or ("timeout", None)."""
    base_url, prompt, columns = request
    try:
        out = await asyncio.wait_for(fn(prompt, columns, **keywords(base_url)), timeout_s)
    except asyncio.TimeoutError:
        return "timeout", None
    except BaseException as e:  # noqa: BLE001 - as play
        return "error", f"{name} raised {type_and_first_line(e)}"
    return scored(out, name)


def scored(out, name: str) -> tuple[str, object]:
    try:
        return "ok", check_score(out, name)
    except ValueError as e:
        return "error", str(e)


def play_many(fn, keywords: Keywords, name: str, requests: list, timeout_s: float) -> tuple[list, bool]:
    """Several episodes at once, each within ``timeout_s``: an async agent's as tasks of one event
    loop, a plain agent's in threads. -> (each one's (status, result)), whether a plain episode
    that passed its time may still be running (its thread cannot be stopped: the worker must go)."""
    if keywords.is_async:
        async def all_of():
            return await asyncio.gather(*(play_async(fn, keywords, name, r, timeout_s) for r in requests))
        return list(asyncio.run(all_of())), False
    threads = ThreadPoolExecutor(len(requests), thread_name_prefix="episode")
    futures = [threads.submit(play, fn, keywords, name, r) for r in requests]
    _, late = wait(futures, timeout=timeout_s)
    threads.shutdown(wait=False)
    return [("timeout", None) if f in late else f.result() for f in futures], bool(late)


def worker_main(conn, spec: str, key: str, memory_mb: int, parent: int) -> None:
    name = f"agent {spec}"

    def load():
        fn = load_function(spec, key)
        keywords = Keywords(fn)
        return lambda batch: play_many(fn, keywords, name, *batch)

    serve(conn, load, what=f"{key} {spec!r}", memory_mb=memory_mb, setting="env.memory_mb", parent=parent)


def _entry() -> None:
    conn, args = entry_args()
    worker_main(conn, *args)


class AgentWorkers:
    """``spec`` in ``workers`` processes, each playing up to ``per_worker`` episodes at once; the
    constructor waits until each has imported it (one that cannot is a one-line ValueError
    naming ``key``)."""

    def __init__(self, spec: str, *, key: str = "env.agent", workers: int, episode_timeout_s: float,
                 memory_mb: int = 0, per_worker: int = 1) -> None:
        if min(workers, per_worker) < 1 or episode_timeout_s <= 0 or memory_mb < 0:
            raise ValueError(f"AgentWorkers: workers={workers} and per_worker={per_worker} must be >= 1, "
                             f"episode_timeout_s={episode_timeout_s} > 0 and memory_mb={memory_mb} >= 0")
        self.spec, self.key, self.timeout_s, self.per_worker = spec, key, float(episode_timeout_s), int(per_worker)
        self.errors = self.timeouts = 0
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
        return {"errors": self.errors, "timeouts": self.timeouts + pool["timeouts"], "crashes": pool["crashes"],
                "restarts": pool["restarts"]}

    def stats(self) -> dict:
        return {"agent_workers": self._pool.alive(), **self.counts}

    def run(self, episodes: dict[int, tuple[str, str, dict]]) -> dict[int, AgentOutcome]:
        """episode id -> (its session's base URL, the prompt's text, its row's columns); every
        episode played, up to ``workers`` x ``per_worker`` at a time -> episode id -> AgentOutcome."""
        todo, out = list(episodes.items()), {}
        while todo or self._pool.busy():
            free = [slot for slot in self._pool.slots if slot.job is None and not slot.broken]
            for n, slot in enumerate(free):
                size = min(self.per_worker, -(-len(todo) // (len(free) - n))) if todo else 0
                if size:
                    batch, todo = todo[:size], todo[size:]
                    # the worker times each episode out itself; this only ends a worker stuck past it
                    self._pool.send(slot, ([r for _, r in batch], self.timeout_s), tuple(e for e, _ in batch),
                                    self.timeout_s + STUCK_GRACE_S)
            for event in self._pool.wait_once():
                out.update(zip(event.job, self._outcomes(event)))
        return out

    def _outcomes(self, event) -> list[AgentOutcome]:
        """The outcomes of one worker's batch of episodes, in its order."""
        if isinstance(event, Answered):
            results, must_go = event.reply
            if must_go:  # a plain episode past its time may still run in a thread: the worker goes
                self._ready(self._pool.replace(event.slot))
            return [self._outcome(status, result) for status, result in results]
        self._ready(self._pool.replace(event.slot))
        if isinstance(event, TimedOut):
            return [self._timed_out() for _ in event.job]
        assert isinstance(event, Died)
        return [AgentOutcome(error=f"agent {self.spec}: its worker process {event.how}", crashed=True)
                for _ in event.job]

    def _outcome(self, status: str, result) -> AgentOutcome:
        if status == "ok":
            return AgentOutcome(score=result)
        if status == "timeout":
            self.timeouts += 1
            return self._timed_out()
        self.errors += 1
        return AgentOutcome(error=result)

    def _timed_out(self) -> AgentOutcome:
        return AgentOutcome(error=f"agent {self.spec} did not finish its episode within env.episode_timeout_s="
                                  f"{self.timeout_s:g} s", timed_out=True)

    def close(self) -> None:
        self._pool.close()

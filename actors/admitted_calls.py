"""Single calls from many callers admitted into a running vLLM engine between its steps.

The gateway's calls (actors/gateway) arrive one at a time, from many sessions at once, each
in a thread of the generator's ``AGENT_CALLS_GROUP``. ``AdmittedCalls.sample`` queues the
call and waits; one driver thread steps the engine while any call runs, adding the queued
ones before each step, so a call joins the batch already running (continuous batching)
rather than waiting for it to finish, and answers each call as soon as its request ends.
``submit`` is the same without waiting: the generator's own episodes played at their own pace
(env.schedule=continuous, actors/environments/continuous.py) admit their turns through it, and
hear of each one's end in a callback.

The driver takes the engine as generate does (actors/engine_turns.py): with partial rollouts
one turn per engine step (a push lands between two steps), otherwise for as long as any
call runs (a push waits until the engine is idle). A request's SamplingParams are made
holding the engine, so its seed comes from the version it starts on.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

from actors.engine_turns import EngineTurns

AGENT_CALLS_GROUP = "agent_calls"  # the generator's Ray concurrency group for the gateway's calls
AGENT_CALLS_CONCURRENCY = 256      # calls a replica holds at once (each waits in a thread of the group)


@dataclass
class _Call:
    prompt: list[int]
    params: Callable[[], tuple]  # -> (SamplingParams, the version now); called holding the engine
    done: threading.Event = field(default_factory=threading.Event)
    output: object = None
    version: int = 0
    error: Optional[BaseException] = None
    then: Optional[Callable[["_Call"], None]] = None  # called in the driver's thread once it ends

    def end(self) -> None:
        self.done.set()
        if self.then is not None:
            self.then(self)


class AdmittedCalls:
    """One engine's admission queue; ``sample`` blocks until its call's request finishes."""

    def __init__(self, *, engine, turns: EngineTurns, adapter: Callable[[], object], stepping: bool,
                 name: str, on_engine: Callable = lambda fn, *args: fn(*args)) -> None:
        """on_engine(fn, *args): runs fn where the engine runs (EngineThread.call), once a step."""
        self._engine, self._turns, self._adapter, self._on_engine = engine, turns, adapter, on_engine
        self._stepping, self._name = stepping, name
        self._queue: list[_Call] = []
        self._wake = threading.Condition()
        self._ids = itertools.count()
        self.admitted = 0
        self.largest_batch = 0  # the most requests one engine step ran
        threading.Thread(target=self._drive_forever, name=f"{name}-admission", daemon=True).start()

    @property
    def waiting(self) -> int:
        """Calls queued for the next step (a snapshot)."""
        return len(self._queue)

    def sample(self, prompt: list[int], params: Callable[[], tuple]) -> tuple[object, int]:
        """-> (vLLM's finished RequestOutput, the version when it was admitted)."""
        call = self._queued(_Call(prompt=list(prompt), params=params))
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.output, call.version

    def submit(self, prompt: list[int], params: Callable[[], tuple],
               then: Callable[[object, int, Optional[BaseException]], None]) -> None:
        """``sample`` without waiting: ``then(output, version, error)`` is called in the driver's
        thread when the call ends (it must be quick and must not raise)."""
        self._queued(_Call(prompt=list(prompt), params=params,
                           then=lambda call: then(call.output, call.version, call.error)))

    def _queued(self, call: _Call) -> _Call:
        with self._wake:
            self._queue.append(call)
            self._wake.notify()
        return call

    def _drive_forever(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._queue)
            self._drive()

    def _drive(self) -> None:
        """Steps the engine until no call runs and none waits."""
        running: dict[str, _Call] = {}
        turn = self._turns.step if self._stepping else contextlib.nullcontext
        with self._turns.stepping_call() if self._stepping else self._turns.sampling():
            try:
                while True:
                    with turn():
                        if not self._on_engine(self._step, running):
                            return
            except BaseException as e:  # noqa: BLE001 - answered to every call it stopped; the driver goes on
                with turn(), contextlib.suppress(Exception):  # the first error is the one to see
                    self._on_engine(self._engine.abort_request, list(running))
                for call in running.values():
                    call.error = e
                    call.end()

    def _step(self, running: dict[str, _Call]) -> bool:
        """The queued calls admitted, one engine step, the calls it finished answered -> whether
        any call ran. One hop to the engine's thread a step, not one per request."""
        self._admit(running)
        if not running:
            return False
        self.largest_batch = max(self.largest_batch, len(running))
        for out in self._engine.step():
            if out.finished and out.request_id in running:
                call = running.pop(out.request_id)
                call.output = out
                call.end()
        return True

    def _admit(self, running: dict[str, _Call]) -> None:
        """The queued calls into the engine; one the engine refuses is answered with its error."""
        from vllm.inputs import tokens_input

        with self._wake:
            new, self._queue = self._queue, []
        for call in new:
            rid = f"{self._name}-call-{next(self._ids)}"
            try:
                params, call.version = call.params()
                self._engine.add_request(rid, tokens_input(call.prompt), params, lora_request=self._adapter())
            except Exception as e:  # noqa: BLE001 - this call's own fault (its params, its prompt)
                call.error = e
                call.end()
                continue
            running[rid] = call
            self.admitted += 1

"""The gateway's calls admitted into a running engine between its steps (actors/admitted_calls.py),
against a stand-in engine whose steps the test releases one at a time: a call that arrives while
others run joins their batch at the next step and is answered when its own request ends; an
engine that refuses one request fails that call alone; a failed step fails the calls it ran and
the next call is served."""
import threading
from types import SimpleNamespace

import pytest

from actors.admitted_calls import AdmittedCalls
from actors.engine_turns import EngineTurns

pytestmark = pytest.mark.unit


class SteppedEngine:
    """A request is finished after as many steps as its params say; each step waits for a tick."""

    def __init__(self):
        self.left, self.batches, self.ticks = {}, [], threading.Semaphore(0)
        self.stepping, self.fail_next_step = threading.Event(), False

    def add_request(self, rid, prompt, steps, lora_request=None):
        if steps < 1:
            raise ValueError("no room for this prompt")
        self.left[rid] = steps

    def step(self):
        self.stepping.set()
        self.ticks.acquire()
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("engine step failed")
        self.batches.append(sorted(self.left))
        out = []
        for rid in list(self.left):
            self.left[rid] -= 1
            out.append(SimpleNamespace(request_id=rid, finished=self.left[rid] == 0))
            if self.left[rid] == 0:
                del self.left[rid]
        return out

    def abort_request(self, rids):
        for rid in rids:
            self.left.pop(rid, None)


def call(calls, steps, results, name):
    def run():
        try:
            results[name] = calls.sample([1, 2, 3], lambda: (steps, 7))
        except Exception as e:  # noqa: BLE001 - the test reads it
            results[name] = e
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def engine():
    engine = SteppedEngine()
    yield engine
    engine.ticks.release(1000)  # let the driver thread finish whatever it holds


def admitted(engine):
    return AdmittedCalls(engine=engine, turns=EngineTurns(), adapter=lambda: None, stepping=False, name="g")


def queued(calls):
    """Waits until a call is queued behind the running step."""
    pause = threading.Event()  # never set: a short wait between looks
    for _ in range(30_000):
        if calls.waiting:
            return
        pause.wait(0.001)
    raise AssertionError("no call was queued within 30 s")


def wait_for_step(engine):
    assert engine.stepping.wait(30)
    engine.stepping.clear()


def test_a_call_joins_the_running_batch_and_is_answered_when_its_request_ends(engine):
    calls, results = admitted(engine), {}
    long = call(calls, 5, results, "long")
    wait_for_step(engine)          # the long call's first step is waiting for its tick
    short = call(calls, 2, results, "short")
    queued(calls)
    for _ in range(3):             # step 1: long alone; steps 2-3: both; the short one ends at 3
        engine.ticks.release()
        wait_for_step(engine)
    short.join(30)
    assert "short" in results and "long" not in results
    assert results["short"][1] == 7 and results["short"][0].finished
    assert engine.batches == [["g-call-0"], ["g-call-0", "g-call-1"], ["g-call-0", "g-call-1"]]
    engine.ticks.release(2)
    long.join(30)
    assert results["long"][0].finished and calls.admitted == 2 and calls.largest_batch == 2


def test_a_refused_request_fails_its_call_alone_and_a_failed_step_fails_the_calls_it_ran(engine):
    calls, results = admitted(engine), {}
    good = call(calls, 3, results, "good")
    wait_for_step(engine)
    bad = call(calls, 0, results, "bad")  # the engine refuses it when it is admitted
    queued(calls)
    engine.ticks.release()
    wait_for_step(engine)                 # step 2 of the good call: the bad one was refused before it
    bad.join(30)
    assert isinstance(results["bad"], ValueError) and "no room" in str(results["bad"]) and good.is_alive()
    engine.ticks.release()
    wait_for_step(engine)                 # step 3, its last
    engine.ticks.release()
    good.join(30)
    assert results["good"][0].finished
    engine.fail_next_step = True
    failed = call(calls, 4, results, "failed")
    wait_for_step(engine)
    engine.ticks.release()
    failed.join(30)
    assert isinstance(results["failed"], RuntimeError) and engine.left == {}  # aborted in the engine
    after = call(calls, 1, results, "after")  # the driver goes on
    wait_for_step(engine)
    engine.ticks.release()
    after.join(30)
    assert results["after"][0].finished

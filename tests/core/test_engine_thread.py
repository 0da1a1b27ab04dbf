"""EngineThread: every call into the engine on one thread, whichever thread asks."""
import threading

import pytest

from core.modeling.engine_thread import EngineThread, OnEngineThread

pytestmark = pytest.mark.unit


class _Engine:
    config = {"dtype": "bfloat16"}

    def step(self):
        return threading.get_ident()

    def fail(self):
        raise RuntimeError("engine error")


class _LLM:
    def __init__(self):
        self.llm_engine = _Engine()

    def generate(self, n):
        return [threading.get_ident()] * n


def test_calls_from_many_threads_run_on_one():
    thread = EngineThread("t")
    llm = OnEngineThread(_LLM(), thread)
    seen = []
    callers = [threading.Thread(target=lambda: seen.extend(llm.generate(2) + [llm.llm_engine.step()]))
               for _ in range(4)]
    for c in callers:
        c.start()
    for c in callers:
        c.join(timeout=30)
    assert len(seen) == 12 and set(seen) == {thread.ident} != {threading.get_ident()}


def test_errors_reach_the_caller_and_nested_calls_run_inline():
    thread = EngineThread("t")
    engine = OnEngineThread(_Engine(), thread, ())
    with pytest.raises(RuntimeError, match="engine error"):
        engine.fail()
    # a call made on the engine thread itself runs at once instead of queueing behind itself
    assert thread.call(lambda: thread.call(threading.get_ident)) == thread.ident


def test_plain_attributes_are_read_where_asked():
    llm = OnEngineThread(_LLM(), EngineThread("t"))
    assert llm.llm_engine.config == {"dtype": "bfloat16"}  # a health check never queues behind a call

"""EngineTurns: sampling and weight updates never hold a generator's engine at once."""
import threading
import time

import pytest

from actors.engine_turns import EngineTurns
from actors.generation import token_versions

pytestmark = pytest.mark.unit


def wait_until(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


def test_an_update_waits_for_a_whole_call():
    turns, order = EngineTurns(), []
    with turns.sampling():
        update = threading.Thread(target=lambda: (turns.claim(), order.append("update"), turns.release()))
        update.start()
        wait_until(lambda: turns.updates_waiting == 1)
        order.append("call ends")
    update.join(10)
    assert order == ["call ends", "update"]
    assert turns.updates_during_sampling == 0  # a whole-call sampler is not "mid-call"


def test_a_waiting_update_goes_before_the_next_step():
    turns, order = EngineTurns(), []

    def next_step():
        with turns.step():
            order.append("step")

    with turns.stepping_call():
        with turns.step():  # a step in progress
            update = threading.Thread(target=lambda: (turns.claim(), order.append("update"), turns.release()))
            update.start()
            wait_until(lambda: turns.updates_waiting == 1)
            stepper = threading.Thread(target=next_step)
            stepper.start()
        update.join(10)
        stepper.join(10)
    assert order == ["update", "step"]
    assert turns.updates_during_sampling == 1 and turns.steps == 2


def test_a_claim_holds_the_engine_until_released():
    """The NCCL transport's round spans three calls: no step may run in between."""
    turns, stepped = EngineTurns(), threading.Event()
    turns.claim()
    stepper = threading.Thread(target=lambda: (turns.step().__enter__(), stepped.set()))
    stepper.start()
    assert not stepped.wait(0.2)
    turns.release()
    assert stepped.wait(10)


def test_token_versions_from_vllm_spans():
    from vllm.outputs import WeightVersionSpan
    spans = [WeightVersionSpan("3", 0, 5), WeightVersionSpan("4", 5, 8)]
    assert token_versions(spans, 8, default=9).tolist() == [3] * 5 + [4] * 3
    assert token_versions(None, 3, default=9).tolist() == [9, 9, 9]  # no labels: the generator's version
    assert token_versions([], 0, default=1).size == 0

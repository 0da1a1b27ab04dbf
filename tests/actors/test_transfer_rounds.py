"""A generator's side of a GPU weight round (actors/weight_receiver.py EngineWeights), against a
stand-in for vLLM's LLM that keeps vLLM's rules (v1/worker/gpu_worker.py): one round open at a
time, a failed receive closes vLLM's side of it, finish needs an open round.

A round holds the engine's turn from start to finish. A round a failed push left open (a
receive failed, or the learner never sent finish) holds it until the learner gives the round
up: by leaving the group (its teardown), starting the next round, or a rollback."""
import threading
from types import SimpleNamespace

import pytest

from actors.engine_turns import EngineTurns
from actors.weight_receiver import EngineWeights

pytestmark = pytest.mark.unit


class StubLLM:
    def __init__(self) -> None:
        self.calls, self.active, self.fail_receive = [], False, False
        self.llm_engine = SimpleNamespace(set_weight_version=lambda v: self.calls.append(("label", v)))

    def collective_rpc(self, method, args=()):
        return ["GPU-0"]

    def init_weight_transfer_engine(self, request):
        self.calls.append(("init", request))

    def start_weight_update(self):
        if self.active:
            raise RuntimeError("start_weight_update called while a weight update is already active.")
        self.active = True
        self.calls.append(("start", None))

    def update_weights(self, request):
        if self.fail_receive:
            self.active = False
            raise RuntimeError("receive failed")
        self.calls.append(("update", request))

    def finish_weight_update(self):
        if not self.active:  # as an engine in its own process reports a worker's error: a bare Exception
            raise Exception("Call to collective_rpc method failed: finish_weight_update called without a "
                            "matching start_weight_update.")
        self.active = False
        self.calls.append(("finish", None))

    def reset_prefix_cache(self, reset_running_requests=False):
        self.calls.append(("reset_cache", None))

    def shutdown_weight_transfer_engine(self):
        if self.active:
            raise RuntimeError("Cannot release a trainer connection during a weight update")
        self.calls.append(("shutdown", None))


def receiver(weight_sync="nccl"):
    llm, turns = StubLLM(), EngineTurns()
    return EngineWeights(llm=llm, turns=turns, name="generator-0", weight_sync=weight_sync), llm, turns


def engine_is_free(turns: EngineTurns) -> bool:
    """Whether a sampler would get the engine now (without waiting)."""
    got = threading.Event()

    def sample():
        with turns.sampling():
            got.set()

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    return got.wait(2.0)


@pytest.mark.parametrize("transport", ["nccl", "ipc"])
def test_a_round_holds_the_engine_from_start_to_finish(transport):
    weights, llm, turns = receiver(transport)
    assert weights.weight_transfer_gpus(transport) == ["GPU-0"]
    weights.init_weight_transfer({"packed": True})
    weights.start_weight_update(3)
    weights.update_weights({"names": ["a"]})
    assert turns.busy  # no sampling while the layers are being reloaded
    assert weights.finish_weight_update(3)["version"] == 3
    assert weights.version() == 3 and ("label", "3") in llm.calls and engine_is_free(turns)
    with pytest.raises(ValueError, match="version 2 is older than the loaded version 3"):
        weights.start_weight_update(2)
    assert engine_is_free(turns)


def test_a_failed_receive_keeps_the_engine_until_the_learner_gives_the_round_up():
    weights, llm, turns = receiver()
    weights.start_weight_update(1)
    llm.fail_receive = True
    with pytest.raises(RuntimeError, match="receive failed"):
        weights.update_weights({"names": ["a"]})
    assert turns.busy  # half-reloaded layers: sampling waits
    weights.shutdown_weight_transfer()  # the learner's teardown
    # vLLM had closed its side: an empty round puts the layers back; then the group is left
    after = [c for c in llm.calls[llm.calls.index(("start", None)) + 1:] if c[0] != "label"]
    assert after == [("start", None), ("finish", None), ("reset_cache", None), ("shutdown", None)]
    assert weights.version() == 0 and not llm.active and engine_is_free(turns)


def test_a_round_left_open_is_given_up_by_the_next_one():
    weights, llm, turns = receiver("ipc")
    weights.start_weight_update(1)
    weights.update_weights({"names": ["a"]})  # the learner died before finish
    weights.start_weight_update(2)  # its replacement's first round
    weights.update_weights({"names": ["a"]})
    weights.finish_weight_update(2)
    assert [c[0] for c in llm.calls if c[0] in ("start", "finish")] == ["start", "finish", "start", "finish"]
    assert weights.version() == 2 and engine_is_free(turns)


def test_a_rollback_gives_an_open_round_up():
    weights, llm, turns = receiver()
    weights.start_weight_update(5)
    weights.rewind(2)
    assert weights.version() == 2 and not llm.active and engine_is_free(turns)


def test_the_learners_transport_must_match_the_generators():
    weights, _, _ = receiver("nccl")
    with pytest.raises(ValueError, match=r"^generator-0.weight_transfer_gpus: this generator was started with "
                                         r"weight_sync='nccl'; the learner's ipc transport needs weight_sync='ipc'"):
        weights.weight_transfer_gpus("ipc")
    cpu, _, _ = receiver("cpu")
    with pytest.raises(ValueError, match="started with weight_sync='cpu'"):
        cpu.init_weight_transfer({"packed": True})
    cpu.shutdown_weight_transfer()  # nothing to leave

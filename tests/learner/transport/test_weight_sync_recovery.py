"""A generator that dies during a GPU weight push (learner/transport/vllm_api.py), on the CPU.

Fake generators (conftest.py) take the round of vLLM's real NCCL trainer engine (its broadcast
recorded: vllm_rounds.RecordedNCCLSync). One is SIGKILLed by its pid while it is inside
update_weights, or between two pushes: the push fails in one line naming it; the transport
tears its group down only when the round had reached the generators; and once the caller
hands it the replacement (as the driver does: cluster/runtime/loop/recovery.py), the next push
forms a group with the new set instead of failing for good.
"""
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from vllm_rounds import RecordedNCCLSync, calls, lm_state

from learner.config import LearnerConfig
from learner.export import WeightExporter
from learner.transport.vllm_api import GeneratorLost

KILL_WAIT_S = 120


def kill(generator) -> None:
    import ray
    os.kill(ray.get(generator.pid.remote()), signal.SIGKILL)


def assert_names_the_dead(err, name: str, during: str) -> None:
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"weight sync: {name} died during {during} (")
    assert "replace it" in message


@pytest.mark.integration
def test_generator_killed_mid_round_then_replaced(fake_generators):
    g0, g1, g2 = fake_generators(3)
    sync = RecordedNCCLSync({"generator-0": g0, "generator-1": g1}, bucket_bytes=1 << 20)
    assert sync.push(1, iter(lm_state()), tied_embeddings=True)["generators"] == 2
    import ray
    ray.get(g1.hold_updates.remote())
    with ThreadPoolExecutor(1) as pool:
        pushing = pool.submit(sync.push, 2, iter(lm_state(1)), tied_embeddings=True)
        assert ray.get(g1.entered.remote(KILL_WAIT_S)), "generator-1 never got update_weights"
        kill(g1)
        with pytest.raises(GeneratorLost) as err:
            pushing.result(timeout=KILL_WAIT_S)
    assert_names_the_dead(err, "generator-1", "update_weights")
    assert sync.broken.startswith("GeneratorLost: weight sync: generator-1 died") and sync.engine is None
    assert ("shutdown", None) in calls(g0)  # the survivor was asked to give the round up and leave

    sync.set_generators({"generator-0": g0, "generator-2": g2})  # the driver's replacement
    report = sync.push(2, iter(lm_state(1)), tied_embeddings=True)
    assert report["generators"] == 2 and report["init_seconds"] > 0 and sync.broken is None
    inits = [c[1] for g in (g0, g2) for c in calls(g) if c[0] == "init"]
    assert [(i["world_size"], i["rank_offset"]) for i in inits[-2:]] == [(3, 1), (3, 2)]  # a group of the new set
    assert ray.get(g2.version.remote()) == 2


@pytest.mark.integration
def test_generator_dead_before_the_round_keeps_the_group(fake_generators):
    g0, g1, g2 = fake_generators(3)
    sync = RecordedNCCLSync({"generator-0": g0, "generator-1": g1}, bucket_bytes=1 << 20)
    sync.push(1, iter(lm_state()), tied_embeddings=True)
    engine = sync.engine
    kill(g1)
    with pytest.raises(GeneratorLost) as err:
        sync.push(2, iter(lm_state()), tied_embeddings=True)
    assert_names_the_dead(err, "generator-1", "version")  # found before the round touched anyone
    assert sync.broken is None and sync.engine is engine
    assert [c[0] for c in calls(g0)].count("start") == 1

    sync.set_generators({"generator-0": g0, "generator-2": g2})  # a new set: the old group goes
    assert sync.engine is None and ("shutdown", None) in calls(g0)
    assert sync.push(2, iter(lm_state()), tied_embeddings=True)["generators"] == 2


@pytest.mark.integration
def test_a_dead_generator_is_named_when_the_group_forms(fake_generators):
    g0, g1 = fake_generators(2)
    kill(g1)
    sync = RecordedNCCLSync({"generator-0": g0, "generator-1": g1})
    with pytest.raises(GeneratorLost) as err:
        sync.push(1, iter(lm_state()), tied_embeddings=True)
    assert_names_the_dead(err, "generator-1", "weight_transfer_gpus")
    assert sync.engine is None


class StubSync:
    def __init__(self, generators, bucket_bytes):
        self.generators, self.bucket_bytes, self.told, self.pushes, self.closed = generators, bucket_bytes, [], 0, 0

    def set_generators(self, generators):
        self.told.append(dict(generators))

    def push(self, version, named, **kwargs):
        list(named)
        self.pushes += 1
        return {"version": version}

    def shutdown(self):
        self.closed += 1


@pytest.mark.unit
def test_exporter_keeps_one_transport_and_tells_it_the_generators(monkeypatch):
    made = []
    monkeypatch.setattr("learner.export.make_weight_sync",
                        lambda kind, gens, bucket_bytes: made.append(StubSync(gens, bucket_bytes)) or made[-1])
    lm = torch.nn.Linear(2, 2)
    engine = SimpleNamespace(module=SimpleNamespace(config=SimpleNamespace(tie_word_embeddings=False), lm=lm))
    exporter = WeightExporter(engine=engine, config=LearnerConfig(weight_sync="ipc", zero_stage=2), rank=0)
    exporter.push_weights({"generator-0": "a"}, 1)
    exporter.push_weights({"generator-0": "a", "generator-2": "c"}, 2)  # a replacement: the same transport, told
    assert len(made) == 1 and made[0].told == [{"generator-0": "a", "generator-2": "c"}] and made[0].pushes == 2
    exporter.push_weights({"generator-0": "a"}, 3, bucket_bytes=1 << 10)  # a new bucket size: a new transport
    assert len(made) == 2 and made[0].closed == 1 and made[1].bucket_bytes == 1 << 10
    exporter.shutdown_weight_sync()
    assert made[1].closed == 1

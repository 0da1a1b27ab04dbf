"""Fixtures shared by the learner tests; helpers.py holds plain functions (importable as
`helpers`: pyproject.toml's pythonpath)."""
import os

import pytest


@pytest.fixture(scope="session")
def pad_id(policy_path):
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(policy_path).pad_token_id


@pytest.fixture(scope="module")
def ray_cluster():
    """The session's shared local Ray (tests/rays.py; GPUs are detected: the GPU tier uses it too)."""
    import rays
    rays.shared()


@pytest.fixture(scope="module")
def fake_generators(ray_cluster):
    """make(n, gpu=None): n Ray actors playing the Generator's side of the GPU transports'
    protocol, recording what reaches them (defined here so Ray ships the class by value: tests
    are not importable there). After ``hold_updates()`` update_weights waits until the actor is
    killed, and ``entered()`` waits until one is in."""
    import itertools
    import threading

    import ray

    from core.infra.weights import WEIGHT_UPDATE_GROUP

    # The update group as actors.generator.actor_class has it; the test's own waits in a group of their own.
    @ray.remote(num_cpus=0, concurrency_groups={WEIGHT_UPDATE_GROUP: 1, "test": 2})
    class FakeGenerator:
        def __init__(self, gpu):
            self.calls, self._version, self.gpu = [], 0, gpu
            self._hold, self._entered = None, threading.Event()

        @ray.method(concurrency_group="test")
        def pid(self):
            return os.getpid()

        def version(self):
            return self._version

        def weight_transfer_gpus(self, transport):
            self.calls.append(("gpus", transport))
            return [self.gpu]

        def init_weight_transfer(self, init_info):
            self.calls.append(("init", init_info))

        def start_weight_update(self, version):
            self.calls.append(("start", version))

        def update_weights(self, update_info):
            self.calls.append(("update", update_info))
            self._entered.set()
            if self._hold is not None:
                self._hold.wait()

        def finish_weight_update(self, version):
            self._version = version
            self.calls.append(("finish", version))
            return {"version": version}

        def shutdown_weight_transfer(self):
            self.calls.append(("shutdown", None))

        def hold_updates(self):
            self._entered.clear()
            self._hold = threading.Event()

        @ray.method(concurrency_group="test")
        def entered(self, timeout):
            return self._entered.wait(timeout)

        def calls_(self):
            return self.calls

    serial = itertools.count()  # each on a GPU of its own (NCCL's check), unless told one (IPC's: the learner's)
    return lambda n, gpu=None: [FakeGenerator.remote(gpu or f"GPU-fake-{next(serial)}") for _ in range(n)]


def _ship_stand_ins_by_value() -> None:
    try:
        import ray.cloudpickle
        import vllm_rounds
    except ImportError:  # a GPU image with torch and DeepSpeed alone: the update's GPU tier still runs
        return
    ray.cloudpickle.register_pickle_by_value(vllm_rounds)


_ship_stand_ins_by_value()

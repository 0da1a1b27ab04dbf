"""Async mode's producer thread stops for certain before a rollback re-queues prompts, or the
rollback fails in one line: a producer that outlived it could take those prompts and strand them."""
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import ray

from cluster.runtime.loop.dispatch import ChunkDispatcher
from cluster.runtime.loop.producer_thread import ProducerThread

CONFIG = Path(__file__).resolve().parents[4] / "configs" / "tiny-cpu.yaml"


class Gate:
    """The producer's issue(): holds the producer thread until opened, longer than any stop timeout."""

    def __init__(self) -> None:
        self.entered, self.opened = threading.Event(), threading.Event()

    def __call__(self) -> list:
        self.entered.set()
        self.opened.wait()
        return []


def _driver(tmp_path):
    """A real async-mode Driver without pools: nothing these tests run reaches an actor."""
    from cluster.config.ppo import load_config
    from cluster.data.prompts import PromptDataset
    from cluster.runtime.loop.driver import Driver
    from cluster.runtime.observe.metrics import RunMetrics

    cfg = load_config(CONFIG, ["run.mode=async"])
    n = cfg.data.prompts_per_step
    prompts = PromptDataset(texts=["p"] * n, prompt_ids=[np.array([1])] * n, ids=np.arange(n))
    return Driver(cfg, pools=None, dataset=prompts, eval_dataset=None, tokenizer=None,
                  metrics=RunMetrics(run_dir=tmp_path, plot_every=0))


@pytest.mark.unit
def test_a_producer_that_outlives_the_stop_fails_the_rollback_in_one_line(tmp_path):
    driver, gate = _driver(tmp_path), Gate()
    driver.prompts.issue = gate
    driver.producer.stop_timeout_s = 0.2
    driver.producer.start()
    assert gate.entered.wait(10)
    try:
        with pytest.raises(RuntimeError) as stuck:
            driver.recovery.stop_producer()  # the rollback's stop
    finally:
        gate.opened.set()
        driver.metrics.close()
    message = str(stuck.value)
    assert "\n" not in message and "producer" in message and f"run.resume={tmp_path}" in message
    assert "test_producer_stop.py" in message  # where it was stuck
    driver.recovery.stop_producer()  # run()'s own stop afterwards does not wait or fail a second time


@pytest.mark.unit
def test_a_stopped_producer_never_takes_the_prompts_a_rollback_requeues():
    rollouts, gate = ChunkDispatcher(None, put_timeout_s=1.0), Gate()  # no pools: no replica to reach
    producer = ProducerThread(rollouts, admit=lambda stop, backlog: True, issue=gate, shaping=lambda: None)
    assert gate.entered.wait(10)
    producer.stop()
    rollouts.reset()  # what the rollback does next: the old timeline forgotten, the checkpoint's prompts re-queued
    requeued = rollouts.ledger.open([5, 6], [[5], [6]])
    rollouts.requeue([requeued])
    gate.opened.set()  # the producer wakes up after all that
    producer.join(10)
    assert rollouts.backlog == [requeued], "the stopped producer took the re-queued prompts"
    producer.take()  # and raised nothing


@ray.remote(max_concurrency=4)
class StuckGenerator:
    """A generator whose sample() runs until released: a generation longer than any stop timeout."""

    def __init__(self) -> None:
        self.called, self.released = threading.Event(), threading.Event()

    def health(self) -> dict:
        return {"ok": True}

    def sample(self, prompt_ids, prompt_indices):
        self.called.set()
        self.released.wait()
        return [], None

    def wait_called(self, timeout_s: float) -> bool:
        return self.called.wait(timeout_s)

    def release(self) -> None:
        self.released.set()


@pytest.fixture
def cluster():
    import rays
    rays.shared()


@pytest.mark.integration
def test_the_stop_does_not_wait_for_a_generate_call_in_flight(cluster):
    from cluster.runtime.pools.pool import Pool

    generators = Pool("generator", start=lambda rid, index, options: StuckGenerator.remote(), num_cpus=0,
                      num_gpus=0, placement_timeout_s=10)
    generators.admit(generators.launch([(0, None)]))
    (handle,) = generators.handles().values()
    rollouts = ChunkDispatcher(SimpleNamespace(generators=generators), put_timeout_s=1.0)
    batches = [rollouts.open([0], [np.array([1])])]  # one batch, then none

    def issue():
        return batches.pop() if batches else []

    producer = ProducerThread(rollouts, admit=lambda stop, backlog: True, issue=issue, shaping=lambda: None)
    try:
        assert ray.get(handle.wait_called.remote(30))
        producer.stop()
        producer.join(10)
        assert not producer.alive, "the producer still waits on its generate call after the stop"
        assert generators.acquire().load == 1  # the abandoned call no longer counts as the replica's load
    finally:
        handle.release.remote()


@ray.remote
class SilentBuffer:
    """A buffer whose take waits out its whole timeout: no rollout ever arrives."""

    def take(self, n, **kwargs):
        threading.Event().wait(kwargs.get("timeout", 600))  # no rollout arrives: never set
        raise TimeoutError("buffer: waited out its timeout")


@pytest.mark.integration
def test_a_failed_producer_ends_a_take_waiting_in_the_buffer_with_its_error(cluster, tmp_path):
    """The take does not sit out the buffer's timeout (10 minutes by default) when the producer
    thread has failed: it ends with the producer's error within a poll."""
    import time

    driver = _driver(tmp_path)

    def issue():
        raise ValueError("the generator returned something unreadable")

    driver.prompts.issue = issue
    buffer = SilentBuffer.remote()
    driver.pools = SimpleNamespace(learner=SimpleNamespace(world_size=1),
                                   buffer_slot=SimpleNamespace(id="buffer-0", handle=buffer))
    driver.producer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(ValueError, match="unreadable"):
            driver._take()
    finally:
        driver.metrics.close()
    assert time.monotonic() - t0 < driver.cfg.buffer.timeout_s / 2

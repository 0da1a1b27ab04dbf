"""The step producers behind one interface: each run.mode has one, and what a take accepts and
what a step reports differ between them only as sync (on-policy) and async (bounded staleness) say."""
import threading
from pathlib import Path
from typing import get_args

import numpy as np
import pytest

from cluster.config.ppo import load_config
from cluster.data.prompts import PromptDataset
from cluster.runtime.loop.ledger import Ledger
from cluster.runtime.loop.producers import PRODUCERS, AsyncProducer, SyncProducer
from cluster.runtime.loop.prompt_stream import PromptStream
from cluster.runtime.observe.produced import Produced
from core.choices import RunMode

pytestmark = pytest.mark.unit

CONFIG = Path(__file__).resolve().parents[4] / "configs" / "tiny-cpu.yaml"


class Dispatcher:
    """A ChunkDispatcher without pools: each produce() stores its chunks' prompts, n samples each."""

    def __init__(self, n: int) -> None:
        self.ledger, self.n, self.lost = Ledger(), n, False

    def open(self, indices, prompt_ids) -> list:
        return [self.ledger.open([int(i) for i in indices], list(prompt_ids))]

    def produce(self, chunks, shaping, stop=None) -> Produced:
        for c in chunks:
            self.ledger.stored(c.id, {i: self.n for i in c.prompt_indices})
        prompts = sum(len(c.prompt_indices) for c in chunks)
        return Produced(prompts=prompts, stored=prompts * self.n)

    def recover_lost_buffer(self) -> bool:
        lost, self.lost = self.lost, False
        return lost


def _producer(kind, *overrides, dispatcher=Dispatcher):
    cfg = load_config(CONFIG, list(overrides))
    n = cfg.data.prompts_per_step
    dataset = PromptDataset(texts=["p"] * 4 * n, prompt_ids=[np.array([1])] * 4 * n, ids=np.arange(4 * n))
    rollouts = dispatcher(cfg.generator.sampling.n)
    prompts = PromptStream(dataset=dataset, prompts_per_step=n, rollouts=rollouts)
    return kind(cfg, rollouts=rollouts, prompts=prompts, shaping=lambda: None), rollouts, prompts


def test_every_run_mode_has_one_producer():
    assert set(PRODUCERS) == set(get_args(RunMode))


def test_sync_takes_only_the_current_version_and_all_it_made():
    producer, rollouts, prompts = _producer(SyncProducer)
    producer.fill(step=1)
    assert prompts.batches_issued == 1 and producer.min_version(5) == 5
    assert producer.take_size(full=64) == (rollouts.ledger.held_rollouts(), False) == (64, False)
    rollouts.lost = True  # a buffer died: its prompts are made again now, and the step reports them
    producer.requeue_lost_buffer()
    produced = producer.for_step()
    assert produced.prompts == 16 and producer.admission_wait_seconds() == 0.0
    assert producer.for_step().prompts == 0  # each step's accounting is reported once


def test_async_takes_within_the_staleness_bound_and_a_full_step():
    producer, _, prompts = _producer(AsyncProducer, "run.mode=async", "buffer.max_staleness=2")
    producer.fill(step=1)  # nothing: its thread produces
    assert prompts.batches_issued == 0
    assert [producer.min_version(v) for v in (0, 1, 5)] == [0, 0, 3]
    assert producer.take_size(full=64) == (64, False)
    producer.stop(at_end=True)  # never started: nothing to stop


def test_sync_with_dynamic_sampling_takes_one_batch_and_leaves_out_the_rest():
    """DAPO's refill: whatever the refills made, the take asks for one step's worth and the buffer
    drops the surplus; short of a step (groups filtered out), it takes what there is."""
    producer, rollouts, _ = _producer(SyncProducer, "ppo.advantage=grpo", "ppo.filter_groups=true")
    producer.fill(step=1)
    held = rollouts.ledger.held_rollouts()
    assert producer.take_size(full=held // 2) == (held // 2, True)
    assert producer.take_size(full=held) == (held, False)
    assert producer.take_size(full=2 * held) == (held, False)
    plain, rollouts, _ = _producer(SyncProducer)  # without it: all that was made, nothing dropped
    plain.fill(step=1)
    assert plain.take_size(full=rollouts.ledger.held_rollouts() // 2) == (rollouts.ledger.held_rollouts(), False)


class StoredBeforeReturn(Dispatcher):
    """A produce() whose rollouts reach the buffer before it returns its accounting (as the real
    one's do: the buffer's put lands, then the dispatcher sees it): it returns once released."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.stored, self.release = threading.Event(), threading.Event()

    def has_backlog(self) -> bool:
        return False

    def produce(self, chunks, shaping, stop=None) -> Produced:
        if not chunks:
            stop.wait()
            return Produced()
        self.issued = [c.id for c in chunks]
        self.stored.set()
        self.release.wait(30)
        return super().produce(chunks, shaping, stop)


def test_async_step_reports_the_batch_it_took_even_when_the_take_beats_the_producers_return():
    producer, rollouts, _ = _producer(AsyncProducer, "run.mode=async", "buffer.max_staleness=0",
                                      dispatcher=StoredBeforeReturn)
    producer.start()
    try:
        assert rollouts.stored.wait(30)
        threading.Timer(0.2, rollouts.release.set).start()  # returns while the take waits
        produced = producer.for_step(consumed=[(c, 0) for c in rollouts.issued])
        assert produced.prompts == 16, "the step's own batch was reported with the next step"
    finally:
        rollouts.release.set()
        producer.stop(at_end=True)

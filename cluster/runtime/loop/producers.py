"""How a step's rollouts are produced: one interface, one implementation per run.mode.

    SyncProducer   on-policy: the step's prompts are generated, scored and stored by the
                   current version before the step takes them (dynamic sampling refills here)
    AsyncProducer  a thread keeps generating with whatever weights the generators hold; the
                   admission gate and the buffer bound how stale a trained rollout may be

The driver calls, each step: ``fill(step)``, then takes from the buffer what ``min_version``
and ``available`` allow (``requeue_lost_buffer`` whenever a buffer died), then ``for_step()``
for the accounting of what fed the step, and ``published()`` once the new version is out.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod

from cluster.runtime.loop.admission import Admission
from cluster.runtime.loop.producer_thread import ProducerStuck, ProducerThread
from cluster.runtime.loop.reward_check import check_invalid_scores
from cluster.runtime.observe.produced import Produced

log = logging.getLogger("tether")


class StepProducer(ABC):
    """This run's rollout production. ``rollouts``: the ChunkDispatcher; ``prompts``: the
    PromptStream; ``shaping()``: the reward shaping of the current KL coefficient."""

    def __init__(self, cfg, *, rollouts, prompts, shaping) -> None:
        self._cfg, self._rollouts, self._prompts, self._shaping = cfg, rollouts, prompts, shaping

    @abstractmethod
    def start(self) -> None:
        """Begin producing (before the first step, and again after a rollback)."""

    @abstractmethod
    def stop(self, *, at_end: bool = False) -> None:
        """Stop producing for certain (ProducerStuck if that cannot be made sure of; ``at_end``:
        the run is over, so a warning instead)."""

    @abstractmethod
    def fill(self, step: int) -> None:
        """Before step ``step``'s take: make what it trains on, if that is made now."""

    @abstractmethod
    def min_version(self, version: int) -> int:
        """The oldest policy version a take at ``version`` accepts."""

    @abstractmethod
    def take_size(self, full: int) -> tuple[int, bool]:
        """(rollouts the take asks the buffer for, whether the buffer drops what it holds beyond
        them), ``full`` being one step's worth."""

    def check(self) -> None:  # noqa: B027 - a no-op unless production runs apart from the take
        """Raise what stopped production for good, if something did: a take waiting in the buffer
        looks here between waits, so it ends with the cause instead of the buffer's timeout."""
        return None

    @abstractmethod
    def requeue_lost_buffer(self) -> None:
        """After a buffer died: queue the prompts it held to be generated again. Called from the
        thread that applies each take's ``consumed``, so a take that finished first is accounted
        before its prompts could be queued again (which would train them twice)."""

    @abstractmethod
    def for_step(self, consumed=()) -> Produced:
        """The accounting of what fed the step just taken (called once per take); ``consumed``:
        the take's (chunk id, prompt index) pairs."""

    @abstractmethod
    def published(self) -> None:
        """A new policy version is out (or a restored one is back): nothing taken at it yet."""

    @abstractmethod
    def admission_wait_seconds(self) -> float:
        """Seconds production waited for admission since the last call (a step's metric)."""


class SyncProducer(StepProducer):
    """On-policy: each step's rollouts come from the current version, and the next generation
    waits for the weight push. With dynamic sampling (ppo.filter_groups) the buffer leaves out
    prompts whose samples all scored alike, and further prompt batches are drawn, up to
    ppo.filter_max_batches in all, until the step holds a full batch of rollouts; the step
    trains on one batch of whole groups, the first in prompt order, and leaves out the rest."""

    def __init__(self, cfg, *, rollouts, prompts, shaping) -> None:
        super().__init__(cfg, rollouts=rollouts, prompts=prompts, shaping=shaping)
        self._made = Produced()
        self._regenerated = Produced()  # a lost buffer's prompts, made again during the take

    def start(self) -> None:
        """Nothing runs between steps."""

    def stop(self, *, at_end: bool = False) -> None:
        """Nothing runs between steps."""

    def fill(self, step: int) -> None:
        cfg = self._cfg
        produced, batches = self._batch(step), 1
        while (cfg.ppo.filter_groups and batches < cfg.ppo.filter_max_batches
               and self._rollouts.ledger.held_rollouts() < cfg.rollouts_per_step):
            more = self._batch(step)
            more.extra_rollouts = more.prompts * cfg.generator.sampling.n
            produced, batches = produced.merge(more), batches + 1
        self._made = produced

    def _batch(self, step: int) -> Produced:
        """One prompt batch generated, scored and stored; a reward failing most of it stops the run."""
        produced = self._rollouts.produce(self._prompts.issue(), self._shaping())
        check_invalid_scores(produced, self._cfg, step)
        return produced

    def min_version(self, version: int) -> int:
        return version

    def take_size(self, full: int) -> tuple[int, bool]:
        """All that was made for this step; with dynamic sampling, one batch of it: after a
        refill the rest (more than ``full``) is left out."""
        held = self._rollouts.ledger.held_rollouts()
        if self._cfg.ppo.filter_groups:
            return min(held, full), held > full
        return held, False

    def requeue_lost_buffer(self) -> None:
        """A lost buffer's prompts are queued and generated now: the take waits for them."""
        if self._rollouts.recover_lost_buffer():
            self._regenerated = self._regenerated.merge(self._rollouts.produce([], self._shaping()))

    def for_step(self, consumed=()) -> Produced:
        produced = self._made.merge(self._regenerated)
        self._made, self._regenerated = Produced(), Produced()
        return produced

    def published(self) -> None:
        """No admission: the next step's prompts are drawn at its start."""

    def admission_wait_seconds(self) -> float:
        return 0.0


class AsyncProducer(StepProducer):
    """Bounded staleness: a producer thread (cluster/runtime/loop/producer_thread.py) generates while the
    learner trains, admitted batch by batch (cluster/runtime/loop/admission.py) so that what it
    issues can be trained within ``buffer.max_staleness`` versions; the buffer drops the rest."""

    def __init__(self, cfg, *, rollouts, prompts, shaping) -> None:
        super().__init__(cfg, rollouts=rollouts, prompts=prompts, shaping=shaping)
        self.admission = Admission(per_step=cfg.rollouts_per_step, max_staleness=cfg.buffer.max_staleness,
                                   outstanding=self._outstanding_rollouts)
        self.stop_timeout_s = 60.0  # how long a stop waits for the thread
        self._thread: ProducerThread | None = None

    def _outstanding_rollouts(self) -> int:
        """Rollouts issued and neither trained nor lost: in the buffer, or on their way there."""
        ledger = self._rollouts.ledger
        return ledger.held_rollouts() + self._cfg.generator.sampling.n * sum(
            len(c.prompt_indices) for c in ledger.in_flight())

    def start(self) -> None:
        self._thread = ProducerThread(self._rollouts, admit=self.admission.wait, issue=self._prompts.issue,
                                      shaping=self._shaping)

    def stop(self, *, at_end: bool = False) -> None:
        """A thread still running could take the prompts a rollback re-queues next."""
        thread = self._thread
        if thread is None or thread.stopping:  # stopped before: a stuck stop was reported then
            return
        thread.stop()
        try:
            thread.join(self.stop_timeout_s)
        except ProducerStuck as e:
            if not at_end:
                raise
            log.warning("%s; the run ends without it", e)

    def fill(self, step: int) -> None:
        """The thread fills the buffer all along."""

    def min_version(self, version: int) -> int:
        return max(0, version - self._cfg.buffer.max_staleness)

    def take_size(self, full: int) -> tuple[int, bool]:
        """A full step: the take waits in the buffer until the thread has stored it."""
        return full, False

    def check(self) -> None:
        self._thread.check()

    def requeue_lost_buffer(self) -> None:
        """A lost buffer's prompts are queued for the thread, which generates them admitted or not."""
        self._rollouts.recover_lost_buffer()

    def for_step(self, consumed=()) -> Produced:
        """Everything the thread produced since the previous step's take, the take's own chunks included."""
        self.admission.took()  # the learner has its batch: the gate counts the next take a version on
        return self._thread.take(consumed_chunks={chunk_id for chunk_id, _ in consumed})

    def published(self) -> None:
        self.admission.published()

    def admission_wait_seconds(self) -> float:
        return self.admission.pop_waited_seconds()


PRODUCERS: dict[str, type[StepProducer]] = {"sync": SyncProducer, "async": AsyncProducer}

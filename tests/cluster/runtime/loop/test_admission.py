"""Async mode's admission by version (cluster/runtime/loop/admission.py)."""
import threading
import time
from collections import deque

import numpy as np
import pytest

from cluster.runtime.loop.admission import Admission, admits

N = 64  # rollouts per step


@pytest.mark.unit
@pytest.mark.parametrize("staleness, taken_ahead, outstanding, admitted", [
    (1, 0, 0, True), (1, 0, N, True), (1, 0, N + 1, False),      # before the take: room for this step and the next
    (1, 1, 0, True), (1, 1, 1, False),                           # while training: one batch ahead at most
    (0, 0, 0, True), (0, 0, N - 1, True), (0, 0, N, False),      # a short next take always gets a batch
    (0, 1, 0, False),                                            # staleness 0: nothing while the learner trains
    (2, 1, N, True), (2, 1, N + 1, False),
])
def test_the_rule(staleness, taken_ahead, outstanding, admitted):
    assert admits(outstanding=outstanding, per_step=N, max_staleness=staleness, taken_ahead=taken_ahead) is admitted


def simulate(staleness: int, steps: int, loss: float, seed: int = 0):
    """Producer and learner taking turns: the producer issues batches while admitted (some rollouts are
    lost on the way), the learner takes N per step, oldest first. Returns each trained rollout's
    staleness (training version - sampling version) and the steps that found too few rollouts."""
    rng, buffer, version, trained, short = np.random.default_rng(seed), deque(), 0, [], 0

    def produce(taken_ahead):
        while admits(outstanding=len(buffer), per_step=N, max_staleness=staleness, taken_ahead=taken_ahead):
            kept = N - int(rng.binomial(N, loss))
            buffer.extend([version] * kept)

    for _ in range(steps):
        produce(taken_ahead=0)
        if len(buffer) < N:
            short += 1
        batch = [buffer.popleft() for _ in range(min(N, len(buffer)))]
        produce(taken_ahead=1)  # while the learner trains
        trained += [version - v for v in batch]
        version += 1
    return np.array(trained), short


@pytest.mark.unit
@pytest.mark.parametrize("staleness", [0, 1, 2, 4])
@pytest.mark.parametrize("loss", [0.0, 0.1])
def test_no_rollout_outlives_the_bound_and_no_step_starves(staleness, loss):
    trained, short = simulate(staleness, steps=300, loss=loss)
    assert short == 0, "the learner found too few rollouts"
    if staleness == 0 and loss > 0:
        # Nothing may be generated ahead, so a short take's extra batch is mostly left for the next
        # version (the buffer drops those): async mode with no staleness allowed wastes on losses.
        return
    assert trained.max() <= staleness
    assert len(trained) == 300 * N


@pytest.mark.unit
def test_without_admission_the_producer_runs_ahead():
    """What the rule prevents: a producer bounded only by buffer room (8 steps' worth) trains on
    rollouts up to 7 versions old, which a staleness bound of 1 would drop."""
    buffer, version, oldest = deque(), 0, 0
    for _ in range(50):
        while len(buffer) + N <= 8 * N:
            buffer.extend([version] * N)
        oldest = max(oldest, version - buffer.popleft())
        for _ in range(N - 1):
            buffer.popleft()
        version += 1
    assert oldest == 7


@pytest.mark.unit
def test_the_gate_waits_for_a_take_or_a_push_and_gives_way_to_a_stop():
    outstanding = [2 * N]
    gate = Admission(per_step=N, max_staleness=1, outstanding=lambda: outstanding[0])
    stop, result = threading.Event(), []
    waiter = threading.Thread(target=lambda: result.append(gate.wait(stop)))
    started = time.monotonic()
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "two steps' worth outstanding: no more before the learner takes"
    outstanding[0] = N
    gate.took()  # the learner took N: the rest is ahead of the next take by a version, so still no
    waiter.join(0.2)
    assert waiter.is_alive()
    gate.published()  # the new version is out: the N left are next step's, one more batch fits
    waiter.join(10)
    elapsed = time.monotonic() - started
    # However fast the machine, the wait is counted, within the time the test took, and once.
    assert result == [True] and 0 < gate.pop_waited_seconds() <= elapsed and gate.pop_waited_seconds() == 0

    stopped = []
    waiter = threading.Thread(target=lambda: stopped.append(gate.wait(stop)))
    outstanding[0] = 2 * N
    waiter.start()
    stop.set()
    waiter.join(10)
    assert stopped == [False]

    # Chunks to generate again (requeued after a resume) are not held behind the gate.
    backlog = threading.Event()
    waiter = threading.Thread(target=lambda: stopped.append(gate.wait(threading.Event(), backlog.is_set)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()
    backlog.set()
    waiter.join(10)
    assert stopped == [False, False] and not waiter.is_alive()


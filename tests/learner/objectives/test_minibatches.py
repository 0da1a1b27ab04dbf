"""The minibatch plan of ranks holding unequal shards: every rank runs the same number of
micro-batches, and the rows trained are one process's minibatches."""
import numpy as np
import pytest

from learner.objectives.minibatches import minibatch_plan, visit_order

pytestmark = pytest.mark.unit


def plans(counts, order, minibatch=4, micro=2):
    return [minibatch_plan(counts, r, order, minibatch, micro) for r in range(len(counts))]


def test_unequal_shards_run_the_same_micro_batches_on_every_rank():
    counts = [3, 4]  # global rows 0-2 on rank 0, 3-6 on rank 1
    rank0, rank1 = plans(counts, visit_order(7, seed=0, step=0, epoch=0, shuffle=False))
    assert [m for _, m in rank0] == [m for _, m in rank1] == [2, 2]  # 3 rows need 2 micro-batches of 2
    assert [rows.tolist() for rows, _ in rank0] == [[0, 1, 2], []]  # nothing of minibatch 1
    assert [rows.tolist() for rows, _ in rank1] == [[0], [1, 2, 3]]


@pytest.mark.parametrize("counts", [[5], [2, 3], [4, 1, 3], [1, 1, 1, 6]])
def test_ranks_together_train_one_processes_minibatches(counts):
    n = sum(counts)
    order = visit_order(n, seed=7, step=3, epoch=1, shuffle=True)
    assert sorted(order.tolist()) == list(range(n))
    starts = np.cumsum([0] + counts)
    per_rank = plans(counts, order)
    for k in range(-(-n // 4)):
        together = sorted(int(starts[r] + i) for r, plan in enumerate(per_rank) for i in plan[k][0])
        assert together == sorted(order[4 * k:4 * k + 4].tolist())
        most = max(len(plan[k][0]) for plan in per_rank)
        assert {plan[k][1] for plan in per_rank} == {-(-most // 2)}


def test_visit_order_is_the_same_on_every_call_and_changes_with_the_step():
    a = visit_order(16, seed=1, step=2, epoch=0, shuffle=True)
    assert np.array_equal(a, visit_order(16, seed=1, step=2, epoch=0, shuffle=True))
    assert not np.array_equal(a, visit_order(16, seed=1, step=3, epoch=0, shuffle=True))
    assert visit_order(5, seed=1, step=2, epoch=0, shuffle=False).tolist() == [0, 1, 2, 3, 4]

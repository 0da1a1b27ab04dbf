"""LearnerReference: the reference "pool" whose one replica is learner rank 0 (reference.on_learner)."""
import pytest

from cluster.runtime.pools.learner_reference import REPLICA, LearnerReference
from cluster.runtime.pools.placement import PlacementError
from learner.group import LearnerRankDied

pytestmark = pytest.mark.unit


class Group:  # the part of a LearnerGroup it reads: the current ranks' handles
    def __init__(self):
        self.workers = ["rank-0 handle", "rank-1 handle"]


def test_its_replica_is_whatever_rank_0_is_now():
    group = Group()
    pool = LearnerReference(group)
    replica = pool.acquire()
    assert (replica.id, replica.handle, len(pool)) == (REPLICA, "rank-0 handle", 1)
    group.workers = ["restarted rank-0", "restarted rank-1"]  # a rollback restarts the group's ranks
    assert pool.handle(REPLICA) == "restarted rank-0" and pool.handle("reference-0") is None
    pool.release(REPLICA)
    assert pool.handles() == {} and pool.replica_nodes() == {}  # listed with the learner, not twice


def test_a_dead_rank_0_rolls_the_run_back_and_the_pool_never_resizes():
    pool = LearnerReference(Group())
    with pytest.raises(LearnerRankDied, match="learner rank 0 died during a reference call"):
        pool.remove(REPLICA)
    assert pool.resize(1) == ([], [])
    with pytest.raises(PlacementError, match="reference.on_learner: learner rank 0 scores the reference; there is "
                                             "no reference pool to resize"):
        pool.resize(2)

"""EnvironmentScores: the reward "pool" of no replicas when the episodes carry their own scores
(env.reward=environment), and the functions its Ray tasks run (actors/rewards/environment_scores.py)."""
import numpy as np
import pytest

from cluster.runtime.pools.environment_scores import REPLICA, EnvironmentScores
from cluster.runtime.pools.placement import PlacementError
from core.rollout import Rollout

pytestmark = pytest.mark.unit
SPEC = "cluster.demo.arithmetic:SecondChance"


def episode(score, error=None):
    return Rollout(prompt_ids=[1], response_ids=[5, 6], behaviour_logprobs=[-1.0, -1.0], finish_reason="stop",
                   policy_version=0, prompt_index=0, sample_index=0, env_score=score, env_error=error)


def test_it_serves_the_dispatcher_as_a_pool_with_nothing_to_list_place_or_size():
    pool = EnvironmentScores(SPEC)
    replica = pool.acquire()
    assert replica.id == REPLICA and pool.handle(REPLICA) is replica.handle is pool.first()
    for method in ("score_rollouts_pulled", "score_rollouts", "health"):  # the reward replica's, as Ray tasks
        assert callable(getattr(replica.handle, method).remote)
    pool.release(REPLICA)
    assert (len(pool), pool.handles(), pool.placements(), pool.replica_nodes()) == (0, {}, {}, {})
    assert pool.handle("reward-0") is None and pool.remove(REPLICA) is False
    with pytest.raises(PlacementError, match=f"^env.reward=environment: the episodes of {SPEC} carry their own "
                                             "scores, so the run has no reward pool to resize"):
        pool.resize(2)


def test_the_pools_sizes_leave_it_out():
    from cluster.runtime.pools.pool import Pools

    class Sized:  # a pool's size is all sizes() reads
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

    pools = Pools(Sized(2), Sized(1), EnvironmentScores(SPEC), learner=None, buffer_slot=None)
    assert pools.sizes() == {"generator": 2, "reference": 1}  # a resumed run starts no pool at 0


def test_its_tasks_pass_the_episodes_scores_on():
    from actors.rewards import environment_scores as episode_scores

    rollouts = [episode(1.5), episode(float("nan"), "environment x did not answer within env.step_timeout_s=1 s")]
    result = episode_scores.score_rollouts(rollouts)
    assert result.scores[0] == 1.5 and np.isnan(result.scores[1]) and list(result.valid) == [True, False]
    assert result.errors == ["environment x did not answer within env.step_timeout_s=1 s (1 of 2 episodes invalid)"]
    pulled, moved = episode_scores.score_rollouts_pulled(rollouts)  # a value, not a Pull: nothing moved
    assert list(pulled.valid) == [True, False] and moved.bytes_cross_node == 0
    assert episode_scores.health()["ok"]

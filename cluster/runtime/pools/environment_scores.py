"""The reward pool when the environment scores (``env.reward: environment``).

An episode's score is its environment rewards summed, carried in the rollout itself
(actors/environments/episodes.py): a reward replica would load a reward it never calls and hold a CPU to
copy numbers. So the run starts no reward pool (actors/rewards/source.py,
``reward_pool_replicas``), and ``EnvironmentScores`` stands where the reward Pool stands: the
dispatcher and the evaluation call its one "replica" as any reward replica, and each call runs
as a Ray task (actors/rewards/environment_scores.py, no CPU reserved), so nothing idles between steps. It
has no replicas to list, place, resize or replace; a task whose worker dies is retried by Ray.
"""
from __future__ import annotations

from types import SimpleNamespace

from cluster.runtime.pools.placement import PlacementError
from cluster.runtime.pools.pool import Replica
from cluster.runtime.pools.stand_in import StandIn

REPLICA = "environment-scores"
TASK_RETRIES = 3  # a worker process that died mid-call (the rollouts are still in the object store)


def _tasks():
    """The reward replica's methods the run calls, as Ray tasks (called as handle.method.remote)."""
    import ray

    from actors.rewards import environment_scores as episode_scores

    task = ray.remote(num_cpus=0, max_retries=TASK_RETRIES)
    return SimpleNamespace(score_rollouts_pulled=task(episode_scores.score_rollouts_pulled),
                           score_rollouts=task(episode_scores.score_rollouts), health=task(episode_scores.health))


class EnvironmentScores(StandIn):
    """The reward "pool" of no replicas: the episodes' own scores, read by Ray tasks."""

    role = "reward"
    replica_id = REPLICA
    has_replicas = False  # Pools.sizes() leaves it out: there is no reward pool to size

    def __init__(self, environment: str) -> None:
        self.environment = environment  # env.environment, for the messages
        self._handle = _tasks()

    # ---- dispatch, as Pool
    def acquire(self) -> Replica:
        return Replica(id=REPLICA, handle=self._handle, placement_group=None)

    def release(self, replica_id: str) -> None:
        """Nothing to balance: every call is a task of its own."""

    def remove(self, replica_id: str) -> bool:
        """Never dead (the dispatcher finds its handle alive): no replica to replace."""
        return False

    def add(self, n: int = 1) -> list[str]:
        raise PlacementError(f"env.reward=environment: the episodes of {self.environment} carry their own scores, "
                             "so the run has no reward pool to resize (with env.reward=pool it has one)")

    def resize(self, n: int) -> tuple[list[str], list[str]]:
        return self.add(n)

    # ---- views, as Pool (the rest: StandIn)
    def first(self):
        return self._handle

    def __len__(self) -> int:
        return 0

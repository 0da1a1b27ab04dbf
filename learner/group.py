"""LearnerGroup: the LearnerWorker ranks as named Ray actors, driven as one.

Every call fans out to all ranks and waits with a timeout, so a dead or failed rank
surfaces as an error naming it instead of a hang.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Optional

from core.infra.errors import type_and_first_line
from core.infra.node_loss import start_placed
from core.infra.placement import on_bundle, wait_placed
from core.infra.ray_calls import drain
from core.infra.transfer import Pull, lost_with_a_node
from learner.config import LearnerConfig, RankConfig
from learner.objectives.objective import Objective
from learner.objectives.ppo import PPOObjective
from learner.rendezvous import RendezvousError, StoreAddress
from learner.transport.base import DEFAULT_BUCKET_BYTES
from learner.worker import LearnerWorker

log = logging.getLogger(__name__)

RENDEZVOUS_ATTEMPTS = 3


class LearnerRankDied(RuntimeError):
    """A rank's process is gone. Found as soon as Ray reports the death (the group waits on
    every rank's call at once, so the survivors' stuck collective does not hide it); the
    group is then useless: restart() it and load a checkpoint."""

    def __init__(self, rank: int, what: str, detail: str) -> None:
        super().__init__(f"learner rank {rank} died during {what}: {detail}")
        self.rank = rank


class LearnerInputLost(LearnerRankDied):
    """A rank's input (its shard of rollouts) was lost with the node that held it. The group is
    as useless as after a death (the other ranks may wait in a collective): same recovery."""

    def __init__(self, rank: int, what: str, detail: str) -> None:
        RuntimeError.__init__(self, f"learner rank {rank} lost its input during {what}: {detail}")
        self.rank = rank


class LearnerGroup:
    """``world_size`` LearnerWorker ranks as named Ray actors (``learner-0``, ...).

    Start-up: the ranks are created (cheap), rank 0 opens the rendezvous store on a port
    the OS picks and keeps, every rank joins it, then every rank builds its engine. A
    failed rendezvous is retried with new actors and a new store, up to
    ``RENDEZVOUS_ATTEMPTS`` times. Afterwards a failed or dead rank surfaces as an error
    naming it (the other ranks then fail their collectives at ``dist_timeout_s``: shut the
    group down and recreate it).

    ``config``: a LearnerConfig or SupervisedConfig is taken as validated; a dict goes through
    ``LearnerConfig.from_dict``. ``objective``: the class every rank trains (learner/objectives/objective.py).
    """

    def __init__(self, *, model: str, config: RankConfig | dict, world_size: int,
                 num_cpus_per_rank: float = 1, num_gpus_per_rank: float = 0, placement_group=None,
                 name_prefix: str = "learner", start_timeout_s: float = 600.0,
                 rendezvous_timeout_s: float = 120.0, call_timeout_s: float = 1800.0,
                 env: Optional[Mapping[str, str]] = None, objective: type[Objective] = PPOObjective) -> None:
        if not isinstance(config, RankConfig):
            config = LearnerConfig.from_dict({**config, "world_size": world_size})
        self.config, self.model, self.world_size = config, str(model), world_size
        self.objective_class = objective  # what every rank trains
        self.call_timeout_s, self.start_timeout_s = call_timeout_s, start_timeout_s
        self.rendezvous_timeout_s = rendezvous_timeout_s  # joining takes seconds; past this, retry
        self._actor_options = dict(num_cpus=num_cpus_per_rank, num_gpus=num_gpus_per_rank,
                                   placement_group=placement_group, name_prefix=name_prefix)
        self._env = dict(env or {})  # environment variables of every rank (e.g. quiet library logs)
        self.workers: list = []
        self._start()

    # ------------------------------------------------------------------ start-up

    def _start(self) -> None:
        for attempt in range(1, RENDEZVOUS_ATTEMPTS + 1):
            self.workers = self._spawn()
            try:
                # Constructors done: config errors surface here, and are not retried.
                self._gather([w.health.remote() for w in self.workers], "start", self.start_timeout_s)
                failure = self._rendezvous()
                if failure is None:
                    self._gather([w.build.remote() for w in self.workers], "build", self.start_timeout_s)
                    return
            except Exception:
                self.shutdown()  # ranks left waiting in a collective would hold their CPUs until the timeout
                raise
            self.shutdown()  # a rank may be stuck in the old rendezvous: new actors, new store
            if attempt == RENDEZVOUS_ATTEMPTS:
                raise RendezvousError(f"learner: rendezvous failed {attempt} times, giving up; "
                                      f"last error: {type_and_first_line(failure)}") from failure
            log.warning("learner: rendezvous failed (%s); retrying with a fresh port (attempt %d/%d)",
                        type_and_first_line(failure), attempt + 1, RENDEZVOUS_ATTEMPTS)

    def _spawn(self) -> list:
        import ray

        opts = self._actor_options
        # CPU ranks must not pick up a CUDA build's default accelerator.
        env = dict(self._env)
        if not opts["num_gpus"]:
            env.setdefault("DS_ACCELERATOR", os.environ.get("DS_ACCELERATOR", "cpu"))
        actor = ray.remote(LearnerWorker)
        return [actor.options(name=f"{opts['name_prefix']}-{r}", num_cpus=opts["num_cpus"],
                              num_gpus=opts["num_gpus"], runtime_env={"env_vars": env} if env else None,
                              **on_bundle(opts["placement_group"], r)).remote(
                    rank=r, world_size=self.world_size, model=self.model, config=self.config, start=False,
                    objective=self.objective_class)
                for r in range(self.world_size)]

    def _rendezvous(self) -> Optional[Exception]:
        """Rank 0 opens the store, every rank joins it; returns the failure, if any."""
        timeout = self.rendezvous_timeout_s
        try:
            address = self._open_store(timeout)
            self._gather([w.join.remote(address) for w in self.workers], "rendezvous", timeout)
        except Exception as e:  # noqa: BLE001 - timeout, unreachable store, a rank lost: all retried
            return e
        return None

    def _open_store(self, timeout: float) -> StoreAddress:
        return self._gather([self.workers[0].open_store.remote()], "open_store", timeout)[0]

    # ------------------------------------------------------------------ the ranks as one

    def train(self, shards: list, **options) -> dict:
        """The objective's train() on every rank (for PPO one update, with ``ptx_rows`` and
        ``kl``, the step's core.kl.KLPenalty). ``shards``: one entry per rank
        (core.rollout.shard_rollouts makes PPO's), each a list or a Ray ObjectRef to one; a ref
        is pulled by its rank (core.infra.transfer), so the rollouts never pass through this
        process, and the ranks' ``transfer/to_learner_*``
        (bytes and seconds across nodes) are summed. ``options``: the objective's, each rank's
        share cut by its ``rank_options`` (PPO: rank r gets the r-th of W equal consecutive
        blocks of the [N, T] ``ptx_rows``, so N must be a multiple of the world size)."""
        import ray
        t0 = time.perf_counter()
        refs = [w.train.remote(Pull(shard) if isinstance(shard, ray.ObjectRef) else shard, **opts)
                for (w, shard), opts in zip(self._per_rank(shards, "train"),
                                            self.objective_class.rank_options(self.world_size, **options))]
        metrics = self.objective_class.merge_train(self._gather(refs, "train"))
        metrics["perf/learner_group_seconds"] = time.perf_counter() - t0
        return metrics

    def evaluate(self, shards: list, **options):
        """The objective's evaluate() of one shard per rank (the supervised objectives' shards may
        differ in length), merged by the objective (SFT, reward model: reduced over the ranks)."""
        refs = [w.evaluate.remote(s, **options) for w, s in self._per_rank(shards, "evaluate")]
        return self.objective_class.merge_evaluate(self._gather(refs, "evaluate"))

    def apply(self, call, shards: list) -> list:
        """Per rank, ``call(objective, shard)``: a call of the objective's own (the reward model's
        ``PreferenceObjective.scores``), passed as the function itself."""
        what = getattr(call, "__name__", "apply")
        return self._gather([w.apply.remote(call, s) for w, s in self._per_rank(shards, what)], what)

    def _per_rank(self, shards: list, what: str) -> list:
        if len(shards) != self.world_size:
            raise ValueError(f"learner.{what}: got {len(shards)} shards for {self.world_size} ranks; "
                             "pass exactly one per rank")
        return list(zip(self.workers, shards))

    def push_weights(self, generators: Mapping, version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict:
        """Send the policy to ``generators`` (replica id -> actor handle of a ``core.infra.weights.WeightReceiver``);
        rank 0's report."""
        if not isinstance(generators, Mapping):
            raise TypeError(f"learner.push_weights: generators must map replica id -> actor handle, "
                            f"got {type(generators).__name__}")
        return self._gather([w.push_weights.remote(generators, version, bucket_bytes) for w in self.workers],
                            "push_weights")[0]

    def state_dict(self) -> dict:
        """Full tensors of the trained module (gathered on rank 0)."""
        return self._gather([w.full_state_dict.remote() for w in self.workers], "state_dict")[0]

    def save(self, out_dir) -> str:
        return self._gather([w.save.remote(str(out_dir)) for w in self.workers], "save")[0]

    def load(self, in_dir) -> int:
        return self._gather([w.load.remote(str(in_dir)) for w in self.workers], "load")[0]

    def save_pretrained_policy(self, out_dir) -> str:
        return self._gather([w.save_pretrained_policy.remote(str(out_dir)) for w in self.workers],
                            "save_pretrained_policy")[0]

    def health(self) -> list[dict]:
        """Per-rank dicts. Queued behind a running call (actors run one call at a time);
        a dead rank still answers at once with an error."""
        return self._gather([w.health.remote() for w in self.workers], "health")

    def shutdown(self) -> None:
        import ray
        for w in self.workers:
            ray.kill(w)
        self.workers = []

    def restart(self, placement_timeout_s: float = 600.0) -> None:
        """New ranks (fresh weights from ``model``) after a rank died; load a checkpoint next.
        A rank's bundle on a node that died is re-placed by Ray on a node with room; after
        ``placement_timeout_s`` without one, LearnerPlacementError. Ranks that die with their
        node while starting (Ray had not yet declared it dead) are started again once Ray has
        re-placed that node's bundles (core/infra/node_loss.py)."""
        self.shutdown()
        start_placed(lambda avoid: self._start_off(avoid, placement_timeout_s), errors=(LearnerRankDied,),
                     timeout_s=placement_timeout_s, what="learner")

    def _start_off(self, avoid: frozenset, placement_timeout_s: float) -> None:
        """_start() once every bundle is placed on a live node outside ``avoid`` and every old
        rank's name is free."""
        import ray
        pg = self._actor_options["placement_group"]
        state = wait_placed(pg, placement_timeout_s, avoid) if pg is not None else None
        if state is not None:
            raise LearnerPlacementError(
                f"learner: its {self.world_size} rank(s) could not be placed again within {placement_timeout_s:.0f}s "
                f"after losing a node (placement {state}); add a node with room for a rank, or lower "
                "learner.replicas")
        deadline = time.monotonic() + 60
        for r in range(self.world_size):  # a killed actor's name frees a moment later
            while time.monotonic() < deadline:
                try:
                    ray.get_actor(f"{self._actor_options['name_prefix']}-{r}")
                except ValueError:
                    break
                time.sleep(0.1)
        self._start()

    def pids(self) -> list[int]:
        return [h["pid"] for h in self.health()]

    def _gather(self, refs: list, what: str, timeout: Optional[float] = None) -> list:
        return _gather(refs, what, timeout or self.call_timeout_s)


class LearnerPlacementError(RuntimeError):
    """The learner's ranks cannot all be placed again (a node died and no other has room)."""


def _gather(refs: list, what: str, timeout: float) -> list:
    """Results in rank order; the first failure raises, naming its rank (ValueError stays one)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    rank_of = {ref: r for r, ref in enumerate(refs)}
    results: list = [None] * len(refs)
    deadline = time.monotonic() + timeout
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0))
        if not ready:
            ranks = sorted(rank_of[r] for r in pending)
            raise GetTimeoutError(f"learner {what}: rank(s) {ranks} did not answer within {timeout:.0f}s")
        rank = rank_of[ready[0]]
        try:
            results[rank] = ray.get(ready[0])
        except RayTaskError as e:
            drain(pending)
            cause = e.cause if getattr(e, "cause", None) is not None else e
            if lost_with_a_node(e):
                raise LearnerInputLost(rank, what, type_and_first_line(cause)) from e
            kind = ValueError if isinstance(cause, ValueError) else RuntimeError
            raise kind(f"learner rank {rank} failed in {what}: {type(cause).__name__}: {cause}") from e
        except RayActorError as e:
            raise LearnerRankDied(rank, what, type_and_first_line(e)) from e
    return results

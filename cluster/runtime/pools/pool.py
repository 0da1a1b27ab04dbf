"""Live pools of actors, each sized independently from the config and changeable while running.

Role classes stay plain Python; `ray.remote` is applied at the edge: here and in
cluster/runtime/pools/launch.py, which starts the run's pools. A Pool is
the live set of one role's replicas: it knows each replica's handle and load, hands
out the least-loaded one, and can add or remove replicas without restarting anything
else. Every replica reserves its resources through its own placement group, so a
replica added mid-run needs no room in a group made at start-up, and one that cannot
be placed fails fast with a message naming the pool and what it asked for. A pool's
``node_labels`` and ``strategy`` choose its nodes (cluster/runtime/pools/placement.py).
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Callable

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import placement_group, remove_placement_group

from actors.generator import engine_process_env
from actors.rewards.source import judge_engines, reward_source
from cluster.config.labels import parse_labels
from cluster.config.ppo import TetherConfig
from cluster.runtime.pools.buffer_slot import BufferSlot
from cluster.runtime.pools.placement import PlacementError, cannot_place, pack_target, spread_target
from cluster.runtime.pools.threads import thread_env
from core.infra.node_loss import off_nodes, start_placed
from core.infra.placement import group_nodes, on_bundle, wait_placed
from learner.group import LearnerGroup

log = logging.getLogger(__name__)

# Libraries' own console output, silenced unless run.library_logs is true: vLLM's INFO
# lines (two per step, and its config dumps) and Hugging Face / vLLM progress bars.
# Warnings and errors still show, from every library.
QUIET_ENV = {"VLLM_LOGGING_LEVEL": "WARNING", "TRANSFORMERS_VERBOSITY": "warning",
             "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"}


def quiet_libraries() -> None:
    """The driver process's share of QUIET_ENV (the actors get it through their runtime_env)."""
    os.environ.update(QUIET_ENV)
    import transformers

    transformers.logging.set_verbosity_warning()
    transformers.logging.disable_progress_bar()


# Ray (2.60 on) leaves CUDA_VISIBLE_DEVICES as it is for an actor that asked for no GPU, so a
# reference or reward replica without num_gpus would run on cuda:0, beside the generator or
# learner that reserved it. With this, such an actor sees no GPU: each pool keeps to its devices.
DEVICE_ISOLATION_ENV = {"RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "1"}


def actor_env(cfg: TetherConfig) -> dict:
    """Environment variables every actor starts with (the learner group adds DS_ACCELERATOR)."""
    return {**DEVICE_ISOLATION_ENV, **({} if cfg.run.library_logs else QUIET_ENV)}


def pool_env(cfg: TetherConfig, pool: str, threads: int) -> dict:
    """Environment variables of one actor of a rollout-side pool: every actor's, its planned
    threads (cluster/runtime/pools/threads.py) and, for a generator or a reward replica with a
    judge (its own or one of reward.sources), where vLLM runs its engine."""
    if pool == "generator":
        engines = [cfg.generator.engine]
    else:
        engines = judge_engines(cfg.reward, reward_source(cfg)) if pool == "reward" else []
    env = {**actor_env(cfg), **thread_env(threads, vllm=bool(engines))}
    if engines:
        tp = cfg.generator.tensor_parallel if pool == "generator" else 1
        env.update(engine_process_env(num_gpus=getattr(cfg, pool).num_gpus, tensor_parallel=tp,
                                      enforce_eager=all(e.enforce_eager for e in engines)))
    return env


def reserve(pool: str, bundles: int, num_cpus: float, num_gpus: float, timeout_s: float,
            name: str | None = None, *, labels: dict | None = None, strategy: str = "pack",
            target: str | None = None, avoid: frozenset = frozenset()):
    """A placement group of ``bundles`` equal bundles, or PlacementError naming the pool.

    ``name`` (default: the pool's) must be unique among the run's live placement groups.
    ``labels``: only on nodes carrying them; ``strategy``: pack or spread (Ray's PACK / SPREAD);
    ``target``: a node id the group prefers, placed elsewhere (among ``labels``' nodes) when that
    node has no room; ``avoid``: nodes seen dying, which the group keeps off.
    """
    bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
    options = {"strategy": "SPREAD" if strategy == "spread" else "PACK"}
    if labels or avoid:
        options["bundle_label_selector"] = [{**(labels or {}), **off_nodes(avoid)} for _ in range(bundles)]
    if target is not None:
        # _soft_target_node_id: an experimental keyword of Ray's public placement_group (STRICT_PACK
        # only): Ray places on the target when it has room, else on any other node that fits, at once.
        options.update(strategy="STRICT_PACK", _soft_target_node_id=target)
    pg = placement_group([dict(bundle) for _ in range(bundles)], name=f"tether-{name or pool}", **options)
    if wait_placed(pg, timeout_s, avoid) is not None:
        remove_placement_group(pg)
        raise PlacementError(cannot_place(pool, bundles, bundle, timeout_s, labels))
    return pg


@dataclass
class Replica:
    id: str                       # also its Ray actor name, e.g. "generator-2"
    handle: object
    placement_group: object
    load: int = 0                 # work items dispatched to it and not finished
    retiring: bool = False        # gets no new work; stopped once its load is 0


class Pool:
    """The live replicas of one role (generator, reference or reward).

    ``start(replica_id, index, options)`` creates the actor (``options`` places it);
    ``index`` counts every replica the pool ever started, so a replacement gets a fresh
    name. Thread-safe: async mode's producer dispatches while the driver scales.
    """

    def __init__(self, role: str, *, start: Callable[[str, int, dict], object], num_cpus: float,
                 num_gpus: float, placement_timeout_s: float, node_labels: str | None = None,
                 strategy: str = "pack") -> None:
        self.role, self._start = role, start
        self._resources = (num_cpus, num_gpus, placement_timeout_s)
        self._labels, self._strategy = parse_labels(node_labels), strategy
        self._nodes: dict[int, str] = {}  # replica index -> the node its placement group is on
        self._replicas: dict[str, Replica] = {}
        self._serial = itertools.count()
        self._lock = threading.Lock()

    # ---- membership
    def reserve(self, n: int, avoid: frozenset = frozenset()) -> list[tuple[int, object]]:
        """(index, placement group) for n new replicas: phase 1 of add, which fails before any
        model loads. An index is never reused, so neither is a replica's name. ``avoid``: nodes
        seen dying, kept off."""
        num_cpus, num_gpus, timeout = self._resources
        bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
        reserved = []
        try:
            for _ in range(n):
                index, target = next(self._serial), self._target(bundle, reserved, avoid)
                reserved.append((index, reserve(self.role, 1, num_cpus, num_gpus, timeout, name=f"{self.role}-{index}",
                                                labels=self._labels, target=target, avoid=avoid)))
                self._nodes[index] = group_nodes(reserved[-1][1]).get(0, "")
        except PlacementError:
            for index, pg in reserved:
                free_placement(pg)
                self._nodes.pop(index, None)
            raise PlacementError(cannot_place(self.role, n, bundle, timeout, self._labels)) from None
        return reserved

    def _target(self, bundle: dict, reserved: list[tuple[int, object]], avoid: frozenset) -> str | None:
        """The node the next replica prefers (cluster/runtime/pools/placement.py): by this pool's
        replicas, live or just reserved, per node; never one of ``avoid``."""
        with self._lock:
            indices = [_index(rid) for rid in self._replicas]
        held = [self._nodes.get(i) for i in indices + [i for i, _ in reserved]]
        held = [node for node in held if node and node not in avoid]
        return spread_target(self._labels, bundle, held, avoid) if self._strategy == "spread" else pack_target(held)

    def start(self, reserved: list[tuple[int, object]]) -> list[str]:
        """Start one replica in each reserved group and wait until each answers health()."""
        return self.admit(self.launch(reserved))

    def launch(self, reserved: list[tuple[int, object]]) -> list[Replica]:
        """Create one replica in each reserved group without waiting for it (admit() waits):
        the pools' engines then load at the same time."""
        return [Replica(f"{self.role}-{index}", self._start(f"{self.role}-{index}", index, on_bundle(pg)), pg)
                for index, pg in reserved]

    def admit(self, started: list[Replica]) -> list[str]:
        """Wait until each launched replica answers health(), then serve it; kill all on an error."""
        try:
            ray.get([r.handle.health.remote() for r in started])  # constructor errors surface here
        except BaseException:
            for r in started:
                kill_replica(r)
            raise
        with self._lock:
            self._replicas.update({r.id: r for r in started})
        return [r.id for r in started]

    def add(self, n: int = 1) -> list[str]:
        """Start ``n`` more replicas. One placed on a node that turns out to be dying (Ray had not
        declared it dead yet) dies unstarted: all are placed again off that node
        (core/infra/node_loss.py), within the pool's placement timeout."""
        return start_placed(lambda avoid: self._add_off(n, avoid), errors=(RayActorError,),
                            timeout_s=self._resources[2], what=f"pool {self.role}")

    def _add_off(self, n: int, avoid: frozenset) -> list[str]:
        reserved = self.reserve(n, avoid)
        try:
            return self.start(reserved)
        except BaseException:
            with self._lock:  # start() freed their placement groups
                for index, _ in reserved:
                    self._nodes.pop(index, None)
            raise

    def remove(self, replica_id: str) -> bool:
        """Stop a replica and free its resources; work in flight on it must be redispatched
        by the caller (the ledger's release() says which). True if it was serving."""
        with self._lock:
            replica = self._replicas.pop(replica_id, None)
            self._nodes.pop(_index(replica_id), None)
        if replica is not None:  # another thread may have removed it already
            kill_replica(replica)
        return replica is not None and not replica.retiring

    def resize(self, n: int) -> tuple[list[str], list[str]]:
        """Grow to or shrink to ``n`` serving replicas: (started ids, retiring ids). A
        retiring replica gets no new work and stops once it has finished what it holds."""
        serving = self.handles()
        if n > len(serving):
            return self.add(n - len(serving)), []
        with self._lock:  # the newest, least-loaded ones go first
            order = sorted((r for r in self._replicas.values() if not r.retiring),
                           key=lambda r: (r.load, -_index(r.id)))
            retiring = order[:len(serving) - n]
            for r in retiring:
                r.retiring = True
        for r in retiring:
            self._stop_if_idle(r.id)
        return [], [r.id for r in retiring]

    # ---- dispatch
    def acquire(self) -> Replica:
        """The least-loaded serving replica, its load raised by one (release() lowers it)."""
        with self._lock:
            serving = [r for r in self._replicas.values() if not r.retiring]
            if not serving:
                raise RuntimeError(f"pool {self.role}: no live replica")
            replica = min(serving, key=lambda r: r.load)
            replica.load += 1
            return replica

    def release(self, replica_id: str) -> None:
        with self._lock:
            if replica_id in self._replicas:  # it may have been removed meanwhile
                self._replicas[replica_id].load -= 1
        self._stop_if_idle(replica_id)

    def _stop_if_idle(self, replica_id: str) -> None:
        with self._lock:
            r = self._replicas.get(replica_id)
            if r is None or not r.retiring or r.load > 0:
                return
            del self._replicas[replica_id]
            self._nodes.pop(_index(replica_id), None)
        log.info("%s retired", replica_id)
        kill_replica(r)

    # ---- views
    def replica_nodes(self) -> dict[int, str]:
        """replica index -> the node its placement group is on, for the replicas placed, a snapshot."""
        with self._lock:
            return dict(self._nodes)

    def handles(self) -> dict:
        """replica id -> actor handle of the serving replicas (not the retiring ones), a snapshot."""
        with self._lock:
            return {rid: r.handle for rid, r in self._replicas.items() if not r.retiring}

    def placements(self) -> dict:
        """replica id -> (actor handle, placement group) of the serving replicas, a snapshot."""
        with self._lock:
            return {rid: (r.handle, r.placement_group) for rid, r in self._replicas.items() if not r.retiring}

    def first(self):
        with self._lock:
            return next(r for r in self._replicas.values() if not r.retiring).handle

    def handle(self, replica_id: str):
        """Any live replica's handle, retiring ones included; None if it is gone."""
        with self._lock:
            r = self._replicas.get(replica_id)
            return None if r is None else r.handle

    def __len__(self) -> int:
        """Serving replicas (retiring ones finish their work but no longer count)."""
        with self._lock:
            return sum(not r.retiring for r in self._replicas.values())

    def shutdown(self) -> None:
        with self._lock:
            replicas, self._replicas = list(self._replicas.values()), {}
        for r in replicas:
            kill_replica(r)


def alive(handle, timeout_s: float = 30.0) -> bool:
    """Whether an actor answers health() (a dead process answers at once with an error)."""
    from ray.exceptions import GetTimeoutError, RayActorError
    try:
        ray.get(handle.health.remote(), timeout=timeout_s)
        return True
    except (RayActorError, GetTimeoutError):
        return False


def kill_replica(replica: Replica) -> None:
    try:
        ray.kill(replica.handle)
    except Exception:  # noqa: BLE001 - already dead is fine
        pass
    free_placement(replica.placement_group)


def free_placement(pg) -> None:
    if pg is None:
        return
    try:
        remove_placement_group(pg)
    except Exception:  # noqa: BLE001 - already removed is fine
        pass


@dataclass
class Pools:
    generators: Pool
    references: Pool
    rewards: Pool
    learner: LearnerGroup
    buffer_slot: BufferSlot
    learner_placement: object = None
    extra_actors: list = field(default_factory=list)  # run-level actors stopped with the pools

    def by_role(self) -> dict:
        """role -> Pool for the rollout-side pools (the roles cluster.scale can resize)."""
        return {"generator": self.generators, "reference": self.references, "reward": self.rewards}

    def sizes(self) -> dict:
        """role -> serving replicas, for the pools the run has (not a stand-in without replicas:
        a resumed run would start that pool at 0)."""
        return {role: len(pool) for role, pool in self.by_role().items() if getattr(pool, "has_replicas", True)}

    @property
    def buffer(self):
        """The current buffer's handle (it changes if the buffer dies and is replaced)."""
        return self.buffer_slot.handle

    def actor_names(self) -> list[str]:
        """Names of the live actors, looked up in Ray (not derived from the config)."""
        names = [rid for pool in (self.generators, self.references, self.rewards) for rid in pool.handles()]
        names += [f"learner-{i}" for i in range(self.learner.world_size)] + [self.buffer_slot.id]
        for name in names:
            ray.get_actor(name)  # ValueError if it is not alive under that name
        return names

    def shutdown(self) -> None:
        for pool in (self.generators, self.references, self.rewards):
            pool.shutdown()
        for stop in (self.buffer_slot.shutdown, self.learner.shutdown, *(
                (lambda a=a: ray.kill(a)) for a in self.extra_actors)):
            try:
                stop()
            except Exception:  # noqa: BLE001 - already dead is fine at shutdown
                pass
        free_placement(self.learner_placement)


def _index(replica_id: str) -> int:
    """generator-3 -> 3: the pool's serial number of a replica."""
    return int(replica_id.rsplit("-", 1)[1])

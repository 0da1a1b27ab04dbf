"""Placement groups and actor pools, each sized independently from the config.

Role classes stay plain Python; `ray.remote` is applied here, at the edge. Every
pool reserves its resources through its own placement group (one bundle per
replica), so a pool that cannot be placed fails fast with a message naming the
pool and what it asked for, instead of waiting forever.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.buffer import RolloutBuffer
from actors.generator import Generator
from actors.reference import Reference
from actors.reward import Reward
from cluster.config import TetherConfig
from learner.worker import LearnerGroup

log = logging.getLogger(__name__)


class PlacementError(RuntimeError):
    """A pool's resources cannot be reserved on this cluster."""


@dataclass
class Pools:
    generators: list
    references: list
    rewards: list
    learner: LearnerGroup
    buffer: object
    placement_groups: list = field(default_factory=list)

    def actor_names(self) -> list[str]:
        """Names of the live actors, looked up in Ray (not derived from the config)."""
        names = [f"{role}-{i}" for role, group in (("generator", self.generators),
                                                  ("reference", self.references),
                                                  ("reward", self.rewards))
                 for i in range(len(group))]
        names += [f"learner-{i}" for i in range(self.learner.world_size)] + ["buffer"]
        for name in names:
            ray.get_actor(name)  # ValueError if it is not alive under that name
        return names

    def shutdown(self) -> None:
        for handle in self.generators + self.references + self.rewards + [self.buffer]:
            try:
                ray.kill(handle)
            except Exception:  # noqa: BLE001 - already dead is fine at shutdown
                pass
        try:
            self.learner.shutdown()
        except Exception:  # noqa: BLE001
            pass
        for pg in self.placement_groups:
            remove_placement_group(pg)


def _bundle(num_cpus: float, num_gpus: float) -> dict:
    b = {"CPU": num_cpus}
    if num_gpus:
        b["GPU"] = num_gpus
    return b


def reserve(pool: str, replicas: int, num_cpus: float, num_gpus: float, timeout_s: float,
            strategy: str = "PACK"):
    """One bundle per replica; raise PlacementError naming the pool if it cannot be placed."""
    bundle = _bundle(num_cpus, num_gpus)
    pg = placement_group([dict(bundle) for _ in range(replicas)], strategy=strategy,
                         name=f"tether-{pool}")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        available = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
        raise PlacementError(
            f"pool {pool}: cannot place {replicas} replica(s) x {bundle} within {timeout_s:.0f}s "
            f"(cluster has {available} free); lower {pool}.replicas or its num_cpus/num_gpus")
    return pg


def _on(pg, index: int) -> dict:
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=index)}


def create_pools(cfg: TetherConfig, *, policy_path: str, tokenizer_path: str) -> Pools:
    """Reserve every pool first (so a shortage fails before any model loads), then start actors."""
    t = cfg.resources.placement_timeout_s
    g, r, w, lp = cfg.generator, cfg.reference, cfg.reward, cfg.learner
    pgs = []
    try:
        for name, pool in (("generator", g), ("reference", r), ("reward", w), ("learner", lp)):
            pgs.append(reserve(name, pool.replicas, pool.num_cpus, pool.num_gpus, t))
        gen_pg, ref_pg, rew_pg, learn_pg = pgs

        generators = [
            ray.remote(Generator).options(name=f"generator-{i}", num_cpus=g.num_cpus,
                                          num_gpus=g.num_gpus, **_on(gen_pg, i)).remote(
                model=policy_path, name=f"generator-{i}",
                sampling=replace(g.sampling, seed=g.sampling.seed + i), engine=g.engine,
                tensor_parallel=g.tensor_parallel, weight_sync=lp.weight_sync)
            for i in range(g.replicas)]
        temperature = g.sampling.temperature
        references = [
            ray.remote(Reference).options(name=f"reference-{i}", num_cpus=r.num_cpus,
                                          num_gpus=r.num_gpus, **_on(ref_pg, i)).remote(
                model=policy_path, temperature=temperature, batch_size=r.batch_size)
            for i in range(r.replicas)]
        rewards = [
            ray.remote(Reward).options(name=f"reward-{i}", num_cpus=w.num_cpus,
                                       num_gpus=w.num_gpus, **_on(rew_pg, i)).remote(
                model=w.model, function=w.function, tokenizer=tokenizer_path,
                batch_size=w.batch_size)
            for i in range(w.replicas)]
        # Many producers may block in put() at once; leave room for stats()/health().
        buffer = ray.remote(RolloutBuffer).options(name="buffer", num_cpus=0,
                                                    max_concurrency=16).remote(
            capacity=cfg.buffer.capacity)
        learner = LearnerGroup(model=policy_path, config=cfg.learner_config(),
                               world_size=lp.replicas, num_cpus_per_rank=lp.num_cpus,
                               num_gpus_per_rank=lp.num_gpus, placement_group=learn_pg)
        pools = Pools(generators, references, rewards, learner, buffer, pgs)
        # Surface constructor errors (bad model path, unimportable reward function) now.
        ray.get([a.health.remote() for a in generators + references + rewards + [buffer]])
        return pools
    except BaseException:
        for pg in pgs:
            remove_placement_group(pg)
        raise

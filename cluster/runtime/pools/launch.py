"""Starting the run's pools: every pool reserved first (so a shortage fails before any model
loads), then every engine loading at once (the pools' actors, and the learner ranks in a
thread), and on any failure everything started so far stopped again."""
from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import Callable

import ray

from actors.generator import actor_class as generator_actor
from actors.reference import Reference
from actors.reward import Reward
from actors.rewards.source import reward_pool_replicas, reward_source
from cluster.config.labels import parse_labels
from cluster.config.ppo import TetherConfig
from cluster.demo.judge import judge_path
from cluster.runtime.pools.environment_scores import EnvironmentScores
from cluster.runtime.pools.gateway import start_gateway
from cluster.runtime.pools.learner_reference import LearnerReference
from cluster.runtime.pools.pool import (
    BufferSlot,
    Pool,
    Pools,
    actor_env,
    free_placement,
    kill_replica,
    pool_env,
    reserve,
)
from cluster.runtime.pools.threads import node_cores, plan_threads, thread_env
from learner.group import LearnerGroup

log = logging.getLogger(__name__)


class _Background:
    """A call run in a thread; result() waits for it (a learner group starting while the
    pools' engines load)."""

    def __init__(self, call: Callable[[], object]) -> None:
        self._value, self._error = None, None
        self._thread = threading.Thread(target=self._run, args=(call,), name="tether-start", daemon=True)
        self._thread.start()

    def _run(self, call) -> None:
        try:
            self._value = call()
        except BaseException as e:  # noqa: BLE001 - handed to result()
            self._error = e

    def result(self, errors: list):
        """The value; a failure is appended to ``errors``. A value nobody will use (``errors``
        not empty) is shut down here."""
        self._thread.join()
        if self._error is not None:
            errors.append(self._error)
        elif errors and self._value is not None:
            self._value.shutdown()
        return self._value


def _role_pools(cfg: TetherConfig, *, policy_path: str, tokenizer_path: str, threads: dict[str, int],
                columns_ref=None, gateway=None, teacher_path: str | None = None) -> tuple[Pool, Pool, Pool]:
    g, r, w, t = cfg.generator, cfg.reference, cfg.reward, cfg.resources.placement_timeout_s
    env = lambda pool: {"env_vars": pool_env(cfg, pool, threads[pool])}  # noqa: E731
    dtype = {role: d for role, (d, _) in cfg.precision().items()}
    lora_rank = cfg.learner.lora.engine_rank(g.engine.max_lora_rank)  # 0: the engines serve no adapter

    def generator(rid, index, options):
        return generator_actor().options(name=rid, num_cpus=g.num_cpus, num_gpus=g.num_gpus,
                                         runtime_env=env("generator"), **options).remote(
            model=policy_path, name=rid, sampling=g.sampling,
            engine=replace(g.engine, dtype=dtype["generator"], max_lora_rank=lora_rank),
            tensor_parallel=g.tensor_parallel,
            weight_sync=cfg.learner.weight_sync, partial_rollouts=cfg.run.mode == "async" and g.partial_rollouts,
            env=cfg.env if cfg.env.enabled else None,
            columns=columns_ref if cfg.env.enabled else None, gateway=gateway)

    def reference(rid, index, options):
        return ray.remote(Reference).options(name=rid, num_cpus=r.num_cpus, num_gpus=r.num_gpus,
                                             runtime_env=env("reference"), **options).remote(
            model=r.model or policy_path, temperature=g.sampling.temperature, top_k=g.sampling.top_k,
            top_p=g.sampling.top_p, batch_size=r.batch_size, packing=r.packing, dtype=dtype["reference"],
            teacher=teacher_path)

    scoring, source = w.scoring(), with_judge_paths(reward_source(cfg))

    def reward(rid, index, options):
        return ray.remote(Reward).options(name=rid, num_cpus=w.num_cpus, num_gpus=w.num_gpus,
                                          runtime_env=env("reward"), **options).remote(
            config=scoring, source=source, tokenizer=tokenizer_path, dtype=dtype["reward"], seed=cfg.run.seed,
            columns=columns_ref)  # every replica, replacements too: the one reference

    return tuple(Pool(role, start=start, num_cpus=p.num_cpus, num_gpus=p.num_gpus, placement_timeout_s=t,
                      node_labels=p.node_labels, strategy=p.strategy)
                 for role, start, p in (("generator", generator, g), ("reference", reference, r),
                                        ("reward", reward, w)))


def with_judge_paths(source):
    """``source`` with each judge (its own, or a reward.sources part's) by the path prepare built or
    found it at (builtin:judge)."""
    if source.type.engine:
        return replace(source, spec=judge_path(source.spec))
    return replace(source, parts=tuple(replace(p, source=with_judge_paths(p.source)) for p in source.parts))


def describe_precision(cfg: TetherConfig) -> str:
    """One line: each role's dtype and why (``model.dtype=auto`` says what it found)."""
    prec = cfg.precision()
    if not reward_source(cfg).holds_model:
        prec = {role: p for role, p in prec.items() if role != "reward"}  # a function reward has no weights
    roles = " ".join(f"{role}={d}" for role, (d, _) in prec.items())
    reasons = sorted({why for _, why in prec.values()} - {"set"})
    return roles + (f" (model.dtype=auto: {'; '.join(reasons)})" if reasons else "")


def actor_dtypes(pools) -> dict[str, str]:
    """actor name -> the dtype it reports computing in (its loaded weights or its engine's):
    what ran, which the start-up line's config-level answer can only promise."""
    handles = {**pools.generators.handles(), **pools.references.handles(), **pools.rewards.handles()}
    health = dict(zip(handles, ray.get([h.health.remote() for h in handles.values()])))
    out = {name: h["dtype"] for name, h in health.items() if "dtype" in h}  # a function reward has none
    for rank, h in enumerate(pools.learner.health()):
        if "dtype" in h:
            out[f"learner-{rank}"] = f"{h['dtype']} (master weights {h['master_dtype']})"
    return out


def learner_line(pools) -> str:
    """What the learner trains, for the start-up log: its parameters, and the adapter's rank."""
    h = pools.learner.health()[0]
    share = h["trainable_parameters"] / max(h["parameters"], 1)
    what = f"a LoRA adapter of rank {h['lora_rank']}" if h["lora_rank"] else "every parameter"
    if h.get("lora_critic"):
        what += " on the policy and one on the critic"
    return (f"learner: trains {what}: {h['trainable_parameters']:,} of {h['parameters']:,} parameters "
            f"({share:.2%})")


def learner_rank_config(cfg: TetherConfig, threads: dict):
    """The ranks' config; with reference.on_learner, the threads rank 0 scores the reference with."""
    config = cfg.learner_config()
    if cfg.reference.on_learner:
        config = replace(config, reference_threads=threads["reference"])
    return config


def _assemble(cfg: TetherConfig, pools: tuple, learner, buffer, learner_pg) -> Pools:
    generators, references, rewards = pools
    if cfg.reference.on_learner:  # learner rank 0 scores the reference: no pool of its own
        references = LearnerReference(learner)
    if reward_pool_replicas(cfg) == 0:  # the episodes carry their scores: no pool of its own
        rewards = EnvironmentScores(cfg.env.player)
    return Pools(generators, references, rewards, learner=learner, buffer_slot=buffer, learner_placement=learner_pg)


def create_pools(cfg: TetherConfig, *, policy_path: str, tokenizer_path: str, columns=None,
                 teacher_path: str | None = None) -> Pools:
    """Reserve every pool first (so a shortage fails before any model loads), then start actors;
    with env.agent the gateway before them all (the generators are handed it).
    ``columns``: the prompt rows' other fields (core.columns.PromptColumns), put in the object
    store here, once, for every reward replica (Ray hands each the table at construction).
    ``teacher_path``: the teacher the reference replicas host (prepare_teacher), or None."""
    gateway, _ = start_gateway(cfg, tokenizer_path=tokenizer_path, env_vars=actor_env(cfg))
    try:
        pools = _start_pools(cfg, policy_path=policy_path, tokenizer_path=tokenizer_path, columns=columns,
                             gateway=gateway, teacher_path=teacher_path)
    except BaseException:
        if gateway is not None:
            ray.kill(gateway)
        raise
    pools.extra_actors += [gateway] if gateway is not None else []
    return pools


def _start_pools(cfg: TetherConfig, *, policy_path: str, tokenizer_path: str, columns, gateway,
                 teacher_path: str | None = None) -> Pools:
    lp = cfg.learner
    threads = plan_threads(cfg, node_cores())
    log.info("threads per actor: %s", " ".join(f"{k}={v}" for k, v in threads.items()))
    log.info("precision: %s", describe_precision(cfg))
    columns_ref = ray.put(columns) if columns is not None and columns.names else None
    pools = _role_pools(cfg, policy_path=policy_path, tokenizer_path=tokenizer_path, threads=threads,
                        columns_ref=columns_ref, gateway=gateway, teacher_path=teacher_path)
    reserved, launched, learner_pg, started, buffer = [], [], None, [], None
    try:
        for pool, n in zip(pools, (cfg.generator.replicas, cfg.reference.pool_replicas, reward_pool_replicas(cfg))):
            reserved.append(pool.reserve(n))
        learner_pg = reserve("learner", lp.replicas, lp.num_cpus, lp.num_gpus, cfg.resources.placement_timeout_s,
                             labels=parse_labels(lp.node_labels), strategy=lp.strategy)
        # Every engine loads at once: the pools' actors, then the learner ranks in a thread.
        for pool, pgs in zip(pools, reserved):
            launched.append(pool.launch(pgs))
        learner_start = _Background(lambda: LearnerGroup(
            model=policy_path, config=learner_rank_config(cfg, threads), world_size=lp.replicas,
            num_cpus_per_rank=lp.num_cpus, num_gpus_per_rank=lp.num_gpus, placement_group=learner_pg,
            env={**actor_env(cfg), **thread_env(threads["learner"])}))
        buffer = BufferSlot(capacity=cfg.buffer.capacity, env=actor_env(cfg), node_labels=cfg.buffer.node_labels,
                            placement_timeout_s=cfg.resources.placement_timeout_s)
        errors = []
        for pool, replicas in zip(pools, launched):
            try:
                pool.admit(replicas)
                started.append(pool)
            except BaseException as e:  # noqa: BLE001 - the others are still waited for, then cleaned up
                errors.append(e)
        learner = learner_start.result(errors)
        if errors:
            raise errors[0]
        return _assemble(cfg, pools, learner, buffer, learner_pg)
    except BaseException:
        for pool in started:
            pool.shutdown()
        for replica in [r for pool, group in zip(pools, launched) if pool not in started for r in group]:
            kill_replica(replica)  # launched, never admitted (admit kills its own on a failure; twice is harmless)
        if buffer is not None:
            buffer.shutdown()
        for pg in [pg for pool, group in zip(pools, reserved) if pool not in started for _, pg in group]:
            free_placement(pg)
        free_placement(learner_pg)
        raise

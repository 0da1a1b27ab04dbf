"""How many CPU threads each actor's torch / OpenMP (and vLLM's CPU worker) runs.

Ray gives an actor OMP_NUM_THREADS = its ``num_cpus``. That is right when the pools
work at the same time (async mode). In sync mode they take turns: generate, then score
(the reference and a reward model together), then learn, then push the weights. With
Ray's rule the learner would train on one of a 2-core machine's cores while the other
idles, which was the whole gap to TRL (docs/performance-record.md, 2026-11-24). So with
``resources.cpu_threads: phase`` (the default) a sync run gives the actors of the phase that
runs the node's cores, split evenly among them. ``num_cpus`` still decides placement.

GPU pools keep Ray's rule: their work runs on the device, and their host threads only
feed it.
"""
from __future__ import annotations

import os


def node_cores() -> int:
    """CPU cores of the largest alive node. On the driver's own node, at most the cores the
    OS gives this process: a local cluster may advertise more CPUs than there are."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    cores = []
    for node in ray.nodes():
        if node.get("Alive"):
            n = int(node.get("Resources", {}).get("CPU", 0))
            if node.get("NodeID") == here:
                n = min(n, len(os.sched_getaffinity(0)))
            cores.append(n)
    return max(cores, default=1) or 1


def phases_take_turns(cfg) -> bool:
    """Whether the CPU pools run one phase at a time, each with the node's cores."""
    return cfg.run.mode == "sync" and cfg.resources.cpu_threads == "phase"


def chunks_per_generator(cfg) -> int:
    """Prompt chunks per generator and step. Two let the scorers start on the first chunk
    while the second is sampled; on CPU pools that take turns that overlap would run the
    generator's and the scorers' threads on the same cores at once (measured on 2 cores,
    31.7M policy: the generate phase took 12.2 s instead of ~6 s), so each generator gets
    its whole share in one call, which also keeps vLLM's batch whole."""
    return 1 if phases_take_turns(cfg) and not cfg.generator.num_gpus else 2


def plan_threads(cfg, cores: int) -> dict[str, int]:
    """Threads per actor of each pool: {"generator", "reference", "reward", "learner"}."""
    pools = {"generator": cfg.generator, "reference": cfg.reference, "reward": cfg.reward,
             "learner": cfg.learner}
    plan = {name: max(1, int(p.num_cpus)) for name, p in pools.items()}  # Ray's rule
    if not phases_take_turns(cfg):
        return plan
    from actors.rewards.source import reward_pool_replicas, reward_source

    computes = reward_source(cfg).holds_model  # a reward function barely computes, the episodes' scores not at all
    # reference.on_learner: learner rank 0 scores the reference in the score phase, a scorer like
    # a reference replica; "reference" is then its threads for those calls (learner.reference_threads).
    references = 1 if cfg.reference.on_learner else cfg.reference.pool_replicas
    scorers = references + (reward_pool_replicas(cfg) if computes else 0)
    share = {"generator": cfg.generator.replicas, "reference": scorers, "learner": cfg.learner.replicas,
             "reward": scorers if computes else 0}
    for name, n in share.items():
        if n and not pools[name].num_gpus:
            plan[name] = max(plan[name], cores // n)
    return plan


def thread_env(threads: int, *, vllm: bool = False) -> dict[str, str]:
    """Environment variables that give an actor ``threads`` threads.

    vLLM's CPU worker binds its OpenMP threads itself and, by default, keeps one core of
    the node for its scheduler process; ours idles while the worker computes (one
    engine, one worker), so the worker gets the threads we plan, unbound.
    """
    env = {"OMP_NUM_THREADS": str(threads)}
    if vllm:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    return env

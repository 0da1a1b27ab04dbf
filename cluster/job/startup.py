"""A job's start before its pools: the start-up clock, joining or starting Ray, and whether a
Ray of our own can hold the pools on this machine.

A run joins the Ray it is given (`ray job submit`, RAY_ADDRESS, resources.address) and
leaves placement to it: a pool that does not fit fails after resources.placement_timeout_s,
naming the pool. Otherwise it starts a local Ray on this machine, sized to what the pools
ask, and first checks that they fit (`check_fits`), since Ray would start every replica it
was told to, however many, and the run would hang in start-up. The check refuses, in one
line naming the largest pool, a run whose

* estimated memory is above this machine's RAM (its total, or a container's limit if
  lower). Per replica: the pool's process as measured on the default job (peak RSS of
  each actor with the ~1M-parameter built-in model, rounded up: `BASE_BYTES`), plus its
  model in host memory (the size of the model's weight files, W): a generator W and its
  KV cache (generator.engine.kv_cache_bytes), a reference W (plus a teacher directory's W),
  a reward model W, a judge W and its KV cache (reward.judge.engine.kv_cache_bytes; a reward
  function or server nothing; with env.reward=environment there is no reward pool), a learner rank its training state:
  parameters, gradients and Adam's two moments, 4 W, divided among the ranks as ZeRO shards
  them (stage 1 the moments, 2 also the gradients, 3 also the parameters; the policy plus a
  separate critic's model).
  A replica with GPUs holds its model on the device: its process only. On top, once:
  Ray's own processes, the driver, the buffer and the control actor (`FIXED_BYTES`).
* CPUs (replicas x num_cpus, summed over the pools) are above resources.num_cpus when
  that sizes the local Ray, else above `MAX_CPUS_PER_CORE` per core of this machine.
"""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import cluster
from actors.rewards.source import reward_pool_replicas, reward_source
from core.infra.errors import InputError

GIB = 1 << 30
POOLS = ("generator", "reference", "reward", "learner")
BASE_BYTES = {"generator": int(0.75 * GIB), "reference": int(0.55 * GIB), "reward": int(0.5 * GIB),
              "learner": int(0.65 * GIB)}  # measured: 0.75, 0.51, 0.48, 0.62 (models and KV cache apart)
FIXED_BYTES = 2 * GIB
MAX_CPUS_PER_CORE = 8  # beyond this the replicas' start-up alone takes minutes
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


_IMPORTS_CLAIMED = []  # holds True once a job of this process has counted the imports


def claim_imports(now: float) -> float:
    """Seconds from the entrypoint package's import (cluster.STARTED) to ``now`` the first time
    a job of this process asks, 0 every later time: a sweep's next trial, or the pipeline's
    PPO stage after its SFT and reward-model stages, imported nothing."""
    if _IMPORTS_CLAIMED:
        return 0.0
    _IMPORTS_CLAIMED.append(True)
    return round(now - cluster.STARTED, 2)


class StartupClock:
    """Seconds from the Python entrypoint's start (cluster.STARTED) to a run ready to step, by
    phase: imports, prepare (models, tokenizer, data), ray (connect or start a local cluster),
    pools (every engine and the learner ranks loaded), then the rest (run folder, control).
    Only a process's first job counts the imports (claim_imports)."""

    def __init__(self) -> None:
        now = time.time()
        self.seconds = {"imports": claim_imports(now)}
        self._last = now

    def lap(self, phase: str) -> None:
        now = time.time()
        self.seconds[phase] = round(now - self._last, 2)
        self._last = now

    def metrics(self) -> dict:
        self.lap("other")
        total = sum(self.seconds.values())
        return {"perf/startup_seconds": total, **{f"perf/startup_{k}_seconds": v for k, v in self.seconds.items()}}

    def line(self) -> str:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in self.seconds.items())
        return f"start-up: {sum(self.seconds.values()):.1f}s ({parts})"


def starts_local_ray(cfg) -> bool:
    """Whether connect_ray() will start a Ray of its own on this machine."""
    import ray

    return not (ray.is_initialized() or cfg.resources.address or os.environ.get("RAY_ADDRESS"))


def connect_ray(cfg) -> Optional[Path]:
    """Join the job's Ray, or start a local one sized to the pools; the folder of that Ray's
    logs (None if this process was connected already). The actors' console output is kept
    there, not forwarded to ours, unless run.library_logs is true (cluster/runtime/observe/console.py)."""
    import ray

    if ray.is_initialized():
        return None
    options = dict(logging_level=logging.WARNING, log_to_driver=bool(cfg.run.library_logs))
    address = cfg.resources.address or os.environ.get("RAY_ADDRESS")
    if address:
        context = ray.init(address=address, **options)
    else:
        # address="local": a new cluster of our own, never an unrelated `ray start` head that
        # happens to run on this machine (ray.init() with no address would join that one).
        # Logical CPUs cover every pool even on a 2-core machine.
        need = math.ceil(sum(p.replicas * p.num_cpus for p in _pools(cfg).values()))
        context = ray.init(address="local", num_cpus=cfg.resources.num_cpus or max(need, os.cpu_count() or 1),
                           **options)
    return Path(context.address_info["session_dir"]) / "logs"


def _pools(cfg) -> dict:
    """name -> config section of the pools the run starts replicas of."""
    pools = {name: getattr(cfg, name) for name in POOLS if hasattr(cfg, name)}
    if getattr(pools.get("reference"), "on_learner", False):  # learner rank 0 scores it: no pool
        del pools["reference"]
    if "reward" in pools and hasattr(cfg, "env") and reward_pool_replicas(cfg) == 0:  # the episodes score
        del pools["reward"]
    return pools


@dataclass(frozen=True)
class Machine:
    ram_bytes: int
    cores: int


def this_machine() -> Machine:
    import psutil

    ram = psutil.virtual_memory().total
    try:  # a container's memory limit (cgroup v2), when it is lower
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        ram = min(ram, int(limit)) if limit.isdigit() else ram
    except OSError:
        pass
    return Machine(ram_bytes=ram, cores=len(os.sched_getaffinity(0)))


def model_bytes(path: Optional[str]) -> int:
    """The size of a model directory's weight files (0 if it is not a local directory)."""
    folder = Path(path) if path else None
    if folder is None or not folder.is_dir():
        return 0
    return sum(f.stat().st_size for f in folder.iterdir() if f.suffix in WEIGHT_SUFFIXES and f.is_file())


def reward_model_bytes(cfg) -> int:
    """A reward replica's model in host memory: a reward model's weights, or a judge's and its
    engine's KV cache; a function or a server holds none. With reward.sources, every source's."""
    source = reward_source(cfg)
    if source.parts:  # a replica holds one scorer per source
        return sum(_source_bytes(p.source, p.config) for p in source.parts)
    return _source_bytes(source, cfg.reward)


def _source_bytes(source, reward) -> int:
    """One source's model in a replica's host memory (``reward``: the settings it is built from)."""
    if not source.holds_model:
        return 0
    if not source.type.engine:
        return model_bytes(source.spec)
    from cluster.demo.judge import judge_path  # the built-in judge, built by prepare already

    return model_bytes(judge_path(source.spec)) + reward.judge.engine.kv_cache_bytes


def training_state_bytes(weights: int, ranks: int, zero_stage: int) -> int:
    """One learner rank's parameters, gradients and Adam's two moments, as ZeRO shards them."""
    params, grads, moments = weights, weights, 2 * weights
    moments //= ranks if zero_stage >= 1 else 1
    grads //= ranks if zero_stage >= 2 else 1
    params //= ranks if zero_stage >= 3 else 1
    return params + grads + moments


def replica_bytes(cfg, policy: Optional[str] = None) -> dict[str, int]:
    """Estimated memory of one replica of each pool (module docstring); ``policy``: the
    policy's model directory (the built-in one once resolved)."""
    g, r, lp = cfg.generator, cfg.reference, cfg.learner
    weights = model_bytes(policy)
    trained = weights + (model_bytes(lp.critic_model) if lp.critic == "separate" else 0)
    on_host = {"generator": weights + g.engine.kv_cache_bytes,
               # a teacher other than the reference's model is a second set of weights in each replica
               "reference": (model_bytes(r.model) if r.model else weights) + model_bytes(cfg.teacher.model),
               "reward": reward_model_bytes(cfg),
               "learner": training_state_bytes(trained, lp.replicas, lp.zero_stage)}
    return {name: BASE_BYTES[name] + (0 if pool.num_gpus else on_host[name]) for name, pool in _pools(cfg).items()}


def fit_problem(cfg, machine: Machine, policy: Optional[str] = None) -> Optional[str]:
    """Why a local Ray on ``machine`` could not hold the pools (one line naming the largest
    pool and the fix), or None."""
    pools, per = _pools(cfg), replica_bytes(cfg, policy)
    memory = {name: p.replicas * per[name] for name, p in pools.items()}
    need = FIXED_BYTES + sum(memory.values())
    if need > machine.ram_bytes:
        name = max(memory, key=memory.get)
        fit = max(0, (machine.ram_bytes - need + memory[name]) // per[name])
        return (f"pool {name}: {pools[name].replicas} replicas x ~{per[name] / GIB:.2f} GiB (estimated) bring the "
                f"run to ~{need / GIB:.1f} GiB, more than this machine's {machine.ram_bytes / GIB:.1f} GiB of RAM; "
                f"lower {name}.replicas (at most {fit} fit here) or run on a Ray cluster with room for them "
                "(resources.address)")
    cpus = {name: p.replicas * p.num_cpus for name, p in pools.items()}
    given = cfg.resources.num_cpus
    limit = given or MAX_CPUS_PER_CORE * machine.cores
    if sum(cpus.values()) <= limit:
        return None
    name = max(cpus, key=cpus.get)
    each = pools[name].num_cpus
    fit = max(0, math.floor((limit - sum(cpus.values()) + cpus[name]) / each))
    bound = f"resources.num_cpus={given}" if given else f"{MAX_CPUS_PER_CORE}x this machine's {machine.cores} cores"
    fix = "raise resources.num_cpus" if given else "run on a Ray cluster with room for them (resources.address)"
    return (f"pool {name}: {pools[name].replicas} replicas x {each:g} CPU bring the run to {sum(cpus.values()):g} "
            f"CPUs, more than {bound}; lower {name}.replicas (at most {fit} fit here) or {fix}")


def check_fits(cfg, policy: Optional[str]) -> None:
    """Refuse (InputError, one line) a run whose local Ray could not hold its pools."""
    if starts_local_ray(cfg):
        problem = fit_problem(cfg, this_machine(), policy)
        if problem:
            raise InputError(problem)

"""The PPO job's checks on its pools (``cfg``: a TetherConfig): sizes, resources, node labels,
and where the reference is scored."""
from __future__ import annotations

from cluster.config.labels import check_node_labels
from core.infra.schema import ConfigError


def check_pools(cfg) -> None:
    """Each pool's size and resources, and where the reference is scored."""
    for name in ("generator", "reference", "reward", "learner"):
        pool = getattr(cfg, name)
        if pool.replicas < 1:
            raise ConfigError(f"config: {name}.replicas={pool.replicas} must be >= 1")
        if pool.num_cpus < 0 or pool.num_gpus < 0:
            raise ConfigError(f"config: {name}.num_cpus/num_gpus must be >= 0")
        check_node_labels(f"{name}.node_labels", pool.node_labels)
    check_node_labels("buffer.node_labels", cfg.buffer.node_labels)
    _check_reference(cfg)
    if cfg.generator.tensor_parallel > 1 and cfg.generator.num_gpus < cfg.generator.tensor_parallel:
        raise ConfigError(f"config: generator.tensor_parallel={cfg.generator.tensor_parallel} needs "
                          f"generator.num_gpus >= {cfg.generator.tensor_parallel} per replica")


def _check_reference(cfg) -> None:
    r, lp = cfg.reference, cfg.learner
    if r.on_learner and (not lp.lora.enabled or r.model or (lp.zero_stage == 3 and lp.replicas > 1)):
        raise ConfigError("config: reference.on_learner=true scores the reference on learner rank 0 as the policy "
                          "with its LoRA adapter off: it needs learner.lora.rank > 0, reference.model=null and, with "
                          "several learner ranks, zero_stage <= 2; set those or reference.on_learner=false")

"""Which folder and checkpoint a run resumes from, and the pool sizes it resumes with.

Resume (``run.resume``):
    <run folder>   continue that run from its newest complete checkpoint
    auto           continue ``run.dir/run.name`` if it has a checkpoint, else start it
A refused resume raises CheckpointError: one line naming the problem and the fix. A resumed
run starts its pools at the sizes the checkpoint recorded (what ``python -m cluster.scale``
last set: the operator's intent), except a pool whose ``<pool>.replicas`` the resume command
line sets; it says so in one line. How a run stops (SIGTERM / SIGINT), leaving a checkpoint
to resume from: cluster/job/signals.py.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

from cluster.config.ppo import SCALABLE_POOLS
from cluster.runtime.state import checkpoint
from cluster.runtime.state.checkpoint import CheckpointError, RunState

log = logging.getLogger("tether")


def resume_source(cfg) -> tuple[Optional[Path], Optional[Path]]:
    """(run folder to reuse, checkpoint to load): (None, None) for a new run; a reused
    folder with no checkpoint yet (``auto`` only) starts from step 0."""
    target = cfg.run.resume
    if target is None:
        return None, None
    if target == "auto":
        if not cfg.run.name:
            raise CheckpointError("run.resume=auto needs run.name (the run to continue or start)")
        run_dir = Path(cfg.run.dir) / cfg.run.name
        if not (run_dir / "status.json").exists():
            return None, None  # nothing to continue: a new run under that name
    else:
        run_dir = Path(target)
        if not (run_dir / "status.json").is_file():
            raise CheckpointError(f"run.resume={target}: not a run folder (no status.json); "
                                  "pass a folder that a previous run created under run.dir")
    found = checkpoint.latest(run_dir)
    if found is None:
        if target == "auto":
            return run_dir, None
        raise CheckpointError(f"run.resume={target}: no complete checkpoint under "
                              f"{run_dir / checkpoint.RESUME_DIR} (the run stopped before its first; "
                              "set run.checkpoint_every > 0 in new runs) ")
    state = checkpoint.load_state(found)
    checkpoint.check_compatible(state, cfg, found)
    if state.step >= cfg.run.steps:
        raise CheckpointError(f"run.resume={target}: the run already trained {state.step} steps of "
                              f"run.steps={cfg.run.steps}; raise run.steps to train further")
    return run_dir, found


def resume_pool_sizes(cfg, state: RunState, overrides: Sequence[str]) -> tuple:
    """(cfg with the pools at the checkpoint's sizes, the line that says so or None): a pool
    whose ``<pool>.replicas`` is among ``overrides`` (the command line's) keeps the config's."""
    given = {o.partition("=")[0].strip() for o in overrides}
    changed = {p: n for p, n in state.pool_sizes.items() if p in SCALABLE_POOLS and n != getattr(cfg, p).replicas}
    kept = {p: n for p, n in changed.items() if f"{p}.replicas" not in given}
    overridden = {p: n for p, n in changed.items() if p not in kept}
    sizes = lambda pools: " ".join(f"{p}={n}" for p, n in pools.items())  # noqa: E731
    said = []
    if kept:
        said.append(f"pools at the sizes they were scaled to: {sizes(kept)} (the config says "
                    f"{sizes({p: getattr(cfg, p).replicas for p in kept})}; set <pool>.replicas on the resume "
                    "command line to choose)")
    said += [f"{p}={getattr(cfg, p).replicas} from the command line (it was scaled to {n})"
             for p, n in overridden.items()]
    cfg = replace(cfg, **{p: replace(getattr(cfg, p), replicas=n) for p, n in kept.items()})
    return cfg, ("resume: " + "; ".join(said)) if said else None


def resumed_config(cfg, path: Path, overrides: Sequence[str]):
    """``cfg`` for resuming from checkpoint ``path``: resume_pool_sizes(), its line logged."""
    cfg, line = resume_pool_sizes(cfg, checkpoint.load_state(path), overrides)
    if line:
        log.info(line)
    return cfg


def resume_config_file(overrides: list[str]) -> Optional[Path]:
    """``run.resume=<folder>`` without --config: the folder's own config.yaml (the overrides
    still apply on top), so a resumed run keeps the settings it was started with."""
    for o in overrides:
        key, _, value = o.partition("=")
        if key.strip() == "run.resume" and value.strip() not in ("", "auto", "null"):
            saved = Path(value.strip()) / "config.yaml"
            return saved if saved.is_file() else None
    return None

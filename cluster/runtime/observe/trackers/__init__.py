"""Experiment trackers (``run.trackers``): TensorBoard, Weights & Biases, MLflow.

``BACKENDS`` is the one table of them; a backend's library is imported only when it is named.
``check_trackers`` refuses what would not start, before the run folder exists; ``open_trackers``
starts them on the run folder; the run's metrics writer hands them its rows (metrics.py)."""
from __future__ import annotations

from pathlib import Path

from cluster.job.errors import UserError
from cluster.runtime.observe.trackers.base import Tracker, TrackerRun, flatten
from cluster.runtime.observe.trackers.mlflow_backend import MLflowTracker, tracking_uri
from cluster.runtime.observe.trackers.tensorboard_backend import TensorBoardTracker
from cluster.runtime.observe.trackers.tracker_set import STATE_FILE, TrackerSet
from cluster.runtime.observe.trackers.wandb_backend import WandbTracker

BACKENDS: dict[str, type[Tracker]] = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker,
                                      "mlflow": MLflowTracker}

__all__ = ["BACKENDS", "STATE_FILE", "TrackerRun", "TrackerSet", "backend_class", "check_trackers",
           "open_trackers", "tracking_uri"]


def backend_class(name: str) -> type[Tracker]:
    if name not in BACKENDS:
        raise UserError(f"run.trackers: {name!r} is unknown; use any of {', '.join(BACKENDS)}")
    return BACKENDS[name]


def tracker_run(run_cfg, *, run_dir: Path, stage: str, config: dict) -> TrackerRun:
    """The run as the trackers file it, from a config's run section (its run.tracking)."""
    t = run_cfg.tracking
    name = f"{t.group}-{run_dir.name}" if t.group else run_dir.name
    return TrackerRun(run_dir=Path(run_dir), name=name, stage=stage, project=t.project, group=t.group,
                      tags=tuple(t.tags), mlflow_uri=t.mlflow_uri, config=flatten(config))


def check_trackers(run_cfg, *, run_dir: Path, stage: str) -> None:
    """Before the run folder exists: an unknown name, a missing package, an unreachable server: a UserError."""
    run = tracker_run(run_cfg, run_dir=run_dir, stage=stage, config={})
    for name in run_cfg.tracker_names():
        backend_class(name).check(run)


def open_trackers(run_cfg, *, run_dir: Path, stage: str, config: dict) -> TrackerSet:
    """The run's trackers, started (a resumed run's reattached); use as a context: leaving it
    by an exception ends the tracker runs as failed (stopped for a stop)."""
    run = tracker_run(run_cfg, run_dir=run_dir, stage=stage, config=config)
    return TrackerSet.start(run_dir, {name: backend_class(name)(run) for name in run_cfg.tracker_names()})

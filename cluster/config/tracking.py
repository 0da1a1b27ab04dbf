"""The experiment trackers a run reports to (``run.trackers``) and what they file it under
(``run.tracking``): the same keys for the PPO job, the SFT and reward-model stages and the pipeline.
The backends themselves, and the table of valid names, are cluster/runtime/observe/trackers/."""
from __future__ import annotations

from typing import Optional

from core.infra.schema import config_class, setting

TRACKERS_HELP = ("experiment trackers that get the config, every metric, the samples, the plots and the final "
                 "checkpoint's path: any of tensorboard, wandb, mlflow (pip install 'tether[trackers]')")


@config_class
class TrackingConfig:
    """What the trackers file the run under: project, group, tags, the MLflow server."""
    project: Optional[str] = setting(None, "W&B project and MLflow experiment; null = WANDB_PROJECT / "
                                           "MLFLOW_EXPERIMENT_NAME, else tether")
    group: Optional[str] = setting(None, "groups related runs (W&B group, MLflow tag tether.group); the pipeline "
                                         "sets its folder name, so its stages are one group")
    tags: tuple[str, ...] = setting((), "tags of the tracker run (W&B tags, MLflow tags tag=true)")
    mlflow_uri: Optional[str] = setting(None, "MLflow tracking URI; null = MLFLOW_TRACKING_URI, else a local "
                                              "SQLite store in the run folder (mlflow/mlflow.db)")


def tracker_names(trackers: tuple[str, ...], tensorboard: bool = False) -> tuple[str, ...]:
    """``trackers`` without repeats, tensorboard added when the ``run.tensorboard`` alias is true."""
    return tuple(dict.fromkeys((*trackers, *(("tensorboard",) if tensorboard else ()))))

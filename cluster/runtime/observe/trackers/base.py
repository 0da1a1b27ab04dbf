"""What every tracker backend implements, and what it is told about the run (``TrackerRun``).

A backend imports its library only in ``start`` (and ``check``): naming no tracker imports none.
The tracker set (tracker_set.py) calls each method at most once per row and keeps a failing
backend from stopping the run; a backend itself just calls its library.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from cluster.job.errors import UserError

INSTALL = "pip install 'tether[trackers]'"
STATUSES = ("finished", "failed", "stopped")  # how a run ends, as the trackers are told


@dataclass(frozen=True)
class TrackerRun:
    """The run as the trackers file it: its folder, names and resolved config."""
    run_dir: Path
    name: str                       # the tracker run's display name
    stage: str                      # ppo, sft, rm: W&B job_type, MLflow tag tether.stage
    project: Optional[str] = None   # null: the backend's environment variable, else "tether"
    group: Optional[str] = None
    tags: tuple[str, ...] = ()
    mlflow_uri: Optional[str] = None
    config: dict = field(default_factory=dict)  # flattened: {"ppo.kl.beta": 0.05, ...}


class Tracker:
    """One backend. ``start`` returns the id that a resumed run passes back to reattach."""

    name = ""      # the run.trackers name
    package = ""   # the pip package, also the module imported
    module = ""    # the module imported, when it differs from the package

    @classmethod
    def check(cls, run: TrackerRun) -> None:
        """Before the run folder exists: raise a UserError naming the fix for what would stop ``start``."""
        if importlib.util.find_spec(cls.module or cls.package) is None:
            raise UserError(f"run.trackers: {cls.name} needs the {cls.package} package, which is missing; "
                            f"{INSTALL} (or pip install {cls.package}), or leave {cls.name} out of run.trackers")

    def fix(self) -> str:
        """What the user can do when ``start`` fails (the end of the start-up error's line)."""
        return f"check the {self.name} settings (run.tracking), or leave {self.name} out of run.trackers"

    def __init__(self, run: TrackerRun) -> None:
        self.run = run

    def start(self, resume_id: Optional[str]) -> str:
        raise NotImplementedError

    def params(self, config: dict) -> None:
        """The resolved config, flattened to dotted keys (only a new tracker run gets them)."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def samples(self, step: int, columns: list[str], rows: list[list]) -> None:
        """A table of samples: ``rows`` of values in ``columns``' order."""

    def plots(self, step: int, paths: dict[str, Path]) -> None:
        """PNG plots by name (reward, kl, eval)."""

    def finish(self, status: str, checkpoint: Optional[str]) -> None:
        raise NotImplementedError


def flatten(config: dict, prefix: str = "") -> dict:
    """{"ppo": {"kl": {"beta": 0.05}}} -> {"ppo.kl.beta": 0.05}; lists become strings."""
    out = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{dotted}."))
        else:
            out[dotted] = value if isinstance(value, (str, int, float, bool)) or value is None else str(value)
    return out

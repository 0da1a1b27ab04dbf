"""Weights & Biases: one W&B run per tether run (per stage), its files under ``<run folder>/wandb``.

``WANDB_MODE=offline`` writes the run there only (``wandb sync <run folder>/wandb/offline-run-*``
uploads it later); ``WANDB_PROJECT``, ``WANDB_ENTITY``, ``WANDB_API_KEY`` are read by wandb itself.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

from cluster.runtime.observe.trackers.base import Tracker

log = logging.getLogger("tether")
EXIT_CODES = {"finished": 0, "stopped": 0, "failed": 1}  # a stopped run is resumable: not a failure


class WandbTracker(Tracker):
    name = package = "wandb"

    def fix(self) -> str:
        return ("run `wandb login` or set WANDB_API_KEY (WANDB_MODE=offline logs without an account), "
                "or leave wandb out of run.trackers")

    def start(self, resume_id: Optional[str]) -> str:
        import wandb

        r = self.run
        # console off: tether's console is its own (cluster/runtime/observe/console.py)
        self.wandb = wandb.init(project=r.project or os.environ.get("WANDB_PROJECT") or "tether", name=r.name,
                                group=r.group, job_type=r.stage, tags=list(r.tags) or None, dir=str(r.run_dir),
                                id=resume_id, resume="allow" if resume_id else None, reinit="create_new",
                                settings=wandb.Settings(console="off", silent=True))
        where = "offline, upload with `wandb sync`" if self.wandb.offline else self.wandb.url
        log.info("wandb: run %s (%s)", self.wandb.id, where)
        return self.wandb.id

    def params(self, config: dict) -> None:
        self.wandb.config.update(config, allow_val_change=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.wandb.log(metrics, step=step)

    def samples(self, step: int, columns: list[str], rows: list[list]) -> None:
        import wandb

        self.wandb.log({"samples": wandb.Table(columns=columns, data=rows)}, step=step)

    def plots(self, step: int, paths: dict[str, Path]) -> None:
        import wandb

        self.wandb.log({f"plots/{name}": wandb.Image(str(path)) for name, path in paths.items()}, step=step)

    def finish(self, status: str, checkpoint: Optional[str]) -> None:
        self.wandb.summary["status"] = status
        if checkpoint:
            self.wandb.summary["checkpoint"] = checkpoint
        self.wandb.finish(exit_code=EXIT_CODES[status])

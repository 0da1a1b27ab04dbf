"""A job's run folder: config.yaml, status.json and the checkpoints folder."""
from __future__ import annotations

import json
import time
from pathlib import Path

from cluster.job.errors import UserError


def make_run_dir(cfg) -> Path:
    name = cfg.run.name or time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(cfg.run.dir) / name
    if (run_dir / "status.json").exists():
        raise UserError(f"run folder {run_dir} already holds a run; choose another run.name")
    try:
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
    except OSError as e:
        raise UserError(f"cannot create run folder {run_dir} ({e.strerror}); set run.dir to a "
                        "writable directory") from None
    return run_dir


def write_status(run_dir: Path, state: str, **extra) -> None:
    tmp = run_dir / ".status.json.tmp"
    tmp.write_text(json.dumps({"state": state, "time": time.time(), **extra}, default=float))
    tmp.replace(run_dir / "status.json")

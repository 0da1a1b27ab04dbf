"""Read back what the experiment trackers wrote, each through its own library's reader: TensorBoard's
event accumulator, MLflow's client on the run's store, and wandb's own transaction-log reader
(`wandb leet inspect --json`) on an offline run's .wandb files."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def tensorboard(run_dir: Path):
    """The run folder's TensorBoard events, every event file of it (a resume adds one), loaded."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    acc.Reload()
    return acc


def tb_scalar(acc, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def tb_text(acc, tag: str) -> list[tuple[int, str]]:
    """Text summaries (add_text) as (step, text); TensorBoard stores them as string tensors."""
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(f"{tag}/text_summary")]


def mlflow_run(run_dir: Path, uri: str | None = None):
    """(client, run) of the run folder's MLflow run (its id from trackers.json)."""
    from mlflow.tracking import MlflowClient

    from cluster.runtime.observe.trackers import STATE_FILE, tracking_uri

    client = MlflowClient(uri or tracking_uri(None, run_dir))
    run_id = json.loads((run_dir / STATE_FILE).read_text())["mlflow"]["id"]
    return client, client.get_run(run_id)


def mlflow_steps(client, run_id: str, key: str) -> list[int]:
    return [m.step for m in sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))]


def wandb_records(run_dir: Path) -> list[list[dict]]:
    """The records of each offline W&B run under ``run_dir/wandb``, oldest first (a resume adds one)."""
    out = []
    for folder in sorted((run_dir / "wandb").glob("offline-run-*"), key=lambda p: p.stat().st_mtime):
        text = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(folder)],
                              capture_output=True, text=True, timeout=120, check=True).stdout
        out.append([json.loads(line) for line in text.splitlines() if line.startswith("{")])
    return out


def wandb_history(records: list[dict]) -> list[dict]:
    """The history rows of one W&B run's records: {"_step": ..., metric: value, ...}."""
    return [r["history"]["item"] for r in records if r["type"] == "history"]


def wandb_summary(records: list[dict]) -> dict:
    summary = {}
    for r in records:
        if r["type"] == "summary":
            summary.update(r["summary"].get("update", {}))
    return summary

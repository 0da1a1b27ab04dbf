"""MLflow: one MLflow run per tether run (per stage), through ``MlflowClient``.

The tracking URI: ``run.tracking.mlflow_uri``, else ``MLFLOW_TRACKING_URI``, else a SQLite store in
the run folder (``mlflow/mlflow.db``, artifacts beside it), so it works with no server:
``mlflow ui --backend-store-uri sqlite:///<run folder>/mlflow/mlflow.db`` shows it.
The final checkpoint is a tag (``tether.checkpoint``): its path, not a copy of the weights.
"""
from __future__ import annotations

import importlib.util
import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

from cluster.job.errors import UserError
from cluster.runtime.observe.trackers.base import INSTALL, Tracker, TrackerRun

STATUSES = {"finished": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}
BATCH = 1000          # MLflow's limit of metrics per log_batch call
PROBE_TIMEOUT_S = 5.0


def local_store_uri(folder: Path) -> str:
    return f"sqlite:///{(Path(folder) / 'mlflow' / 'mlflow.db').resolve()}"


def tracking_uri(configured: Optional[str], folder: Path) -> str:
    """run.tracking.mlflow_uri, else MLFLOW_TRACKING_URI, else the local store in ``folder``."""
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or local_store_uri(folder)


def metric_key(key: str) -> str:
    """MLflow takes letters, digits, _ - . / and spaces in a metric name (a data source's name may hold others)."""
    return re.sub(r"[^\w\-./ ]", "_", key)


class MLflowTracker(Tracker):
    name = "mlflow"
    package = "mlflow"

    @classmethod
    def check(cls, run: TrackerRun) -> None:
        super().check(run)
        uri = tracking_uri(run.mlflow_uri, run.run_dir)
        if uri.startswith("sqlite:") and importlib.util.find_spec("sqlalchemy") is None:
            raise UserError(f"run.trackers: mlflow's local store {uri} needs sqlalchemy and alembic; {INSTALL} "
                            "(or pip install mlflow), or set run.tracking.mlflow_uri to a server")
        if uri.startswith(("http://", "https://")):
            try:  # any HTTP answer means a server is there; MLflow's own client would retry for minutes
                urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=PROBE_TIMEOUT_S).close()
            except urllib.error.HTTPError:
                pass
            except OSError as e:
                raise UserError(f"run.trackers: mlflow cannot reach the tracking server {uri} "
                                f"({getattr(e, 'reason', e)}); start it or fix run.tracking.mlflow_uri / "
                                "MLFLOW_TRACKING_URI, or leave mlflow out of run.trackers") from None

    def fix(self) -> str:
        return ("check run.tracking.mlflow_uri / MLFLOW_TRACKING_URI (null: a local store in the run folder), "
                "or leave mlflow out of run.trackers")

    def start(self, resume_id: Optional[str]) -> str:
        from mlflow.tracking import MlflowClient

        r = self.run
        uri = tracking_uri(r.mlflow_uri, r.run_dir)
        self.client = MlflowClient(uri)
        if resume_id:
            self.client.update_run(resume_id, status="RUNNING")
            self.id = resume_id
            return resume_id
        experiment = self._experiment(uri, r.project or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "tether")
        tags = {"tether.stage": r.stage, "tether.run_dir": str(r.run_dir.resolve()),
                **({"tether.group": r.group} if r.group else {}), **{t: "true" for t in r.tags}}
        self.id = self.client.create_run(experiment, run_name=r.name, tags=tags).info.run_id
        return self.id

    def _experiment(self, uri: str, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        # a local store keeps its artifacts beside its database; a server decides for itself
        local = Path(uri.removeprefix("sqlite:///")).parent / "artifacts" if uri.startswith("sqlite:///") else None
        return self.client.create_experiment(name, artifact_location=local.as_uri() if local else None)

    def params(self, config: dict) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)) for k, v in config.items()]
        for i in range(0, len(items), 100):  # MLflow's limit of params per call
            self.client.log_batch(self.id, params=items[i:i + 100])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(metric_key(k), v, now, step) for k, v in metrics.items()]
        for i in range(0, len(items), BATCH):
            self.client.log_batch(self.id, metrics=items[i:i + BATCH])

    def samples(self, step: int, columns: list[str], rows: list[list]) -> None:
        table = {c: [row[i] for row in rows] for i, c in enumerate(columns)}
        self.client.log_table(self.id, data=table, artifact_file=f"samples/step-{step:06d}.json")

    def plots(self, step: int, paths: dict[str, Path]) -> None:
        for path in paths.values():
            self.client.log_artifact(self.id, str(path), artifact_path="plots")

    def finish(self, status: str, checkpoint: Optional[str]) -> None:
        self.client.set_tag(self.id, "tether.status", status)
        if checkpoint:
            self.client.set_tag(self.id, "tether.checkpoint", str(Path(checkpoint).resolve()))
        self.client.set_terminated(self.id, STATUSES[status])

"""The experiment trackers' table, their start-up errors, and what TensorBoard and MLflow get from a
run's metrics writer, read back from their real stores (W&B, which starts a service process, is
in tests/e2e/test_resume.py, with the SIGTERM/resume pair). One short run, resumed, serves the
read-back tests (module fixture)."""
from __future__ import annotations

import json
import logging
import socket
from pathlib import Path

import pytest
from tracker_stores import mlflow_run, mlflow_steps, tb_scalar, tb_text, tensorboard

from cluster.config.loader import load
from cluster.config.ppo import TetherConfig
from cluster.config.stages import SFTConfig
from cluster.job.errors import Stopped, UserError
from cluster.runtime.observe.metrics import RunMetrics
from cluster.runtime.observe.trackers import BACKENDS, STATE_FILE, backend_class, check_trackers, open_trackers
from cluster.runtime.observe.trackers.base import Tracker, TrackerRun, flatten

pytestmark = pytest.mark.unit
BOTH = ["run.trackers=[tensorboard,mlflow]", "run.tracking.tags=[tiny]", "run.tracking.group=g"]


def config(*overrides, cls=TetherConfig):
    return load(cls, None, list(overrides))


def row(step: int) -> dict:
    return {"reward/mean": 0.5 * step, "kl/mean": 0.1 * step, "eval/score_mean": float("nan"), "note": "text"}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> Path:
    """Steps 0-4 with samples at 2 and plots; then a resume from step 2 that redoes 3-4 and adds 5-6."""
    run_dir = tmp_path_factory.mktemp("runs") / "short"
    run_dir.mkdir()
    cfg = config(*BOTH)
    with open_trackers(cfg.run, run_dir=run_dir, stage="ppo", config=cfg.to_dict()) as trackers:
        m = RunMetrics(run_dir=run_dir, plot_every=2, trackers=trackers)
        for step in range(5):
            m.log(step, row(step))
            if step == 2:
                m.samples(step, [{"prompt": "The cat", "response": " was glad.", "score": 1.5,
                                  "columns": {"source": "demo"}}])
        m.close("stopped")
    with open_trackers(cfg.run, run_dir=run_dir, stage="ppo", config=cfg.to_dict()) as trackers:
        m = RunMetrics(run_dir=run_dir, plot_every=0, trackers=trackers)
        m.rewind(2)  # what a resume from the checkpoint of step 2 does
        for step in range(3, 7):
            m.log(step, {**row(step), "reward/mean": 100.0 + step})
        m.close("finished", checkpoint=str(run_dir / "checkpoints" / "final"))
    return run_dir


def test_the_table_names_every_backend_and_a_bad_name_lists_them():
    assert list(BACKENDS) == ["tensorboard", "wandb", "mlflow"]
    assert all(BACKENDS[name].name == name for name in BACKENDS)
    with pytest.raises(UserError, match=r"^run.trackers: 'wnadb' is unknown; use any of tensorboard, wandb, mlflow$"):
        backend_class("wnadb")


def test_the_tensorboard_alias_adds_tensorboard_once():
    assert config("run.tensorboard=true").run.tracker_names() == ("tensorboard",)
    assert config("run.tensorboard=true", "run.trackers=[mlflow,tensorboard]").run.tracker_names() == \
        ("mlflow", "tensorboard")
    assert config().run.tracker_names() == ()
    assert config("run.trackers=[wandb]", cls=SFTConfig).run.tracker_names() == ("wandb",)


def test_a_missing_package_is_one_line_naming_the_backend_and_the_fix(tmp_path):
    class Absent(Tracker):
        name, package = "absent", "tether_no_such_package"

    with pytest.raises(UserError) as e:
        Absent.check(TrackerRun(run_dir=tmp_path, name="r", stage="ppo"))
    assert str(e.value) == ("run.trackers: absent needs the tether_no_such_package package, which is missing; "
                            "pip install 'tether[trackers]' (or pip install tether_no_such_package), or leave "
                            "absent out of run.trackers")


def test_an_unreachable_mlflow_server_is_one_line_before_the_run_folder(tmp_path):
    with socket.socket() as s:  # a port nothing listens on: bound, never listened
        s.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{s.getsockname()[1]}"
        with pytest.raises(UserError, match=rf"^run.trackers: mlflow cannot reach the tracking server {uri} .*; "
                                            "start it or fix run.tracking.mlflow_uri"):
            check_trackers(config("run.trackers=[mlflow]", f"run.tracking.mlflow_uri={uri}").run,
                           run_dir=tmp_path / "run", stage="ppo")
    assert not (tmp_path / "run").exists()


def test_a_tracker_that_cannot_start_is_one_line_and_ends_the_others(tmp_path):
    cfg = config("run.trackers=[tensorboard,mlflow]", "run.tracking.mlflow_uri=nosuchscheme://x")
    with pytest.raises(UserError) as e:
        open_trackers(cfg.run, run_dir=tmp_path, stage="ppo", config={})
    line = str(e.value)
    assert line.startswith("run.trackers: mlflow did not start (") and "\n" not in line
    assert line.endswith("check run.tracking.mlflow_uri / MLFLOW_TRACKING_URI (null: a local store in the run "
                         "folder), or leave mlflow out of run.trackers")
    assert tb_text(tensorboard(tmp_path), "status") == [(0, "failed")]  # the one that started was ended


def test_mlflow_gets_the_config_every_row_once_samples_plots_checkpoint_and_status(resumed):
    client, run = mlflow_run(resumed)
    rid = run.info.run_id
    assert run.info.status == "FINISHED" and run.data.tags["tether.status"] == "finished"
    assert run.data.tags["tether.checkpoint"] == str((resumed / "checkpoints" / "final").resolve())
    assert run.data.tags["tether.group"] == "g" and run.data.tags["tiny"] == "true"
    assert run.data.tags["mlflow.runName"] == "g-short" and run.data.tags["tether.stage"] == "ppo"
    assert run.data.params["ppo.kl.beta"] == "0.05" and run.data.params["run.trackers"] == "['tensorboard', 'mlflow']"
    # the resume reattached the same run; steps 3-4 kept their first values, 5-6 came on top, none twice
    assert mlflow_steps(client, rid, "reward/mean") == [0, 1, 2, 3, 4, 5, 6]
    values = {m.step: m.value for m in client.get_metric_history(rid, "reward/mean")}
    assert values[4] == 2.0 and values[5] == 105.0
    assert "eval/score_mean" not in run.data.metrics and "note" not in run.data.metrics  # numbers only
    assert [a.path for a in client.list_artifacts(rid, "plots")] == [f"plots/{n}.png" for n in ("eval", "kl", "reward")]
    table = json.loads(Path(client.download_artifacts(rid, "samples/step-000002.json")).read_text())
    assert table["columns"] == ["prompt", "response", "score", "columns"]
    assert table["data"] == [["The cat", " was glad.", 1.5, '{"source": "demo"}']]
    assert not any(a.path.startswith("checkpoints") for a in client.list_artifacts(rid))  # a path, not a copy


def test_tensorboard_gets_every_row_once_samples_plots_and_status(resumed):
    acc = tensorboard(resumed)
    assert [s for s, _ in tb_scalar(acc, "reward/mean")] == [0, 1, 2, 3, 4, 5, 6]
    assert dict(tb_scalar(acc, "reward/mean"))[5] == 105.0
    assert "eval/score_mean" not in acc.Tags()["scalars"]
    assert sorted(acc.Tags()["images"]) == ["plots/eval", "plots/kl", "plots/reward"]
    (step, text), = tb_text(acc, "samples")
    assert step == 2 and "| The cat |  was glad. | 1.5 |" in text
    assert [t for _, t in tb_text(acc, "status")] == ["stopped", "finished"]
    assert json.loads((resumed / STATE_FILE).read_text())["tensorboard"]["last_step"] == 6


def test_metrics_jsonl_keeps_the_redone_steps(resumed):
    """metrics.jsonl holds the run as it is now (the redone steps); the trackers kept the first values."""
    rows = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6] and rows[4]["reward/mean"] == 104.0


def test_a_tracker_failing_mid_run_warns_once_and_the_run_goes_on(tmp_path, caplog):
    cfg = config("run.trackers=[tensorboard,mlflow]")
    with open_trackers(cfg.run, run_dir=tmp_path, stage="ppo", config={}) as trackers:
        m = RunMetrics(run_dir=tmp_path, plot_every=0, trackers=trackers)
        m.log(1, row(1))
        client, run = mlflow_run(tmp_path)
        client.delete_run(run.info.run_id)  # the run is gone from under us: every later call fails
        with caplog.at_level(logging.WARNING, logger="tether"):
            for step in (2, 3, 4):
                m.log(step, row(step))
            m.samples(4, [{"prompt": "p", "response": "r"}])
        m.close("finished")
    warnings = [r.getMessage() for r in caplog.records if "tracker" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("tracker mlflow failed (") and "training goes on" in \
        warnings[0]
    assert trackers.names == ("tensorboard",)
    assert [s for s, _ in tb_scalar(tensorboard(tmp_path), "reward/mean")] == [1, 2, 3, 4]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4


@pytest.mark.parametrize("error, status", [(RuntimeError("boom"), "FAILED"), (Stopped("stop", 143, run_dir=Path()),
                                                                            "KILLED")])
def test_a_run_that_ends_by_an_error_ends_its_tracker_run_so(tmp_path, error, status):
    cfg = config("run.trackers=[mlflow]")
    with pytest.raises(type(error)):
        with open_trackers(cfg.run, run_dir=tmp_path, stage="sft", config={}) as trackers:
            trackers.log(1, {"sft/loss": 1.0})
            raise error
    assert mlflow_run(tmp_path)[1].info.status == status


def test_flatten_gives_dotted_keys():
    assert flatten({"ppo": {"kl": {"beta": 0.05}}, "run": {"trackers": ("wandb",), "name": None}}) == \
        {"ppo.kl.beta": 0.05, "run.trackers": "('wandb',)", "run.name": None}

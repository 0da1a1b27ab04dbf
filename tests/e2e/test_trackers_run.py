"""A short real PPO job with all three experiment trackers, then its resume, read back from what
each tracker wrote (W&B offline through wandb's own reader, MLflow's client on the run folder's
store, TensorBoard's event reader): every metrics.jsonl row at its step, once; the config; the
samples table; the plots; the final checkpoint's path; the end status. One run serves every test."""
import json
import math
from pathlib import Path

import pytest
import tracker_stores as stores

from cluster import train

pytestmark = pytest.mark.e2e
SHORT = ["run.checkpoint_every=2", "run.eval_every=0", "run.samples_every=2", "run.plot_every=3",
         "run.trackers=[tensorboard,wandb,mlflow]", "run.tracking.tags=[e2e]"]


@pytest.fixture(scope="module")
def resumed(cluster, tmp_path_factory) -> Path:
    """Steps 0-3 and the final checkpoint; then run.steps=4 resumed from the checkpoint of step 2."""
    tmp = tmp_path_factory.mktemp("runs")
    run_dir = tmp / "tracked"
    with pytest.MonkeyPatch.context() as env:  # W&B offline, its caches in the test's folder
        for key, value in (("WANDB_MODE", "offline"), ("WANDB_PROJECT", "tether-e2e"),
                           ("WANDB_DATA_DIR", tmp / "wandb-data"), ("WANDB_CACHE_DIR", tmp / "wandb-cache"),
                           ("WANDB_CONFIG_DIR", tmp / "wandb-config")):
            env.setenv(key, str(value))
        env.delenv("MLFLOW_TRACKING_URI", raising=False)
        assert train.main([f"run.dir={tmp}", "run.name=tracked", "run.steps=3", *SHORT]) == 0
        assert train.main([f"run.dir={tmp}", "run.name=tracked", "run.steps=4", f"run.resume={run_dir}", *SHORT]) == 0
    assert json.loads((run_dir / "status.json").read_text())["resumed_from_step"] == 2
    return run_dir


def rows(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl by step, its finite numbers (what the trackers get)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        out[row["step"]] = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                            and math.isfinite(v) and k not in ("step", "time")}
    return out


def test_metrics_jsonl_has_each_step_once(resumed):
    assert list(rows(resumed)) == [0, 1, 2, 3, 4]


def test_mlflow_has_every_row_once_config_samples_plots_and_the_checkpoint(resumed):
    client, run = stores.mlflow_run(resumed)
    rid, written = run.info.run_id, rows(resumed)
    assert run.info.status == "FINISHED" and run.data.tags["tether.status"] == "finished"
    assert run.data.tags["tether.checkpoint"] == str((resumed / "checkpoints" / "final").resolve())
    assert run.data.params["run.steps"] == "3" and run.data.params["ppo.kl.beta"] == "0.05"  # the first start's
    assert run.data.tags["e2e"] == "true" and run.data.tags["tether.stage"] == "ppo"
    assert stores.mlflow_steps(client, rid, "kl/beta") == [1, 2, 3, 4]
    assert stores.mlflow_steps(client, rid, "perf/startup_seconds") == [0]  # the resume starts after step 0
    for step in (1, 2, 4):  # step 3 was redone after the resume: the tracker keeps the first one's values
        for key, value in written[step].items():
            got = [m.value for m in client.get_metric_history(rid, key) if m.step == step]
            assert got == [pytest.approx(value, rel=1e-6, abs=1e-9)], (step, key)
    assert [a.path for a in client.list_artifacts(rid, "samples")] == ["samples/step-000002.json",
                                                                        "samples/step-000004.json"]
    assert {a.path for a in client.list_artifacts(rid, "plots")} >= {"plots/reward.png", "plots/kl.png"}


def test_wandb_continues_one_run_with_no_step_twice(resumed):
    first, second = stores.wandb_records(resumed)
    ids = {r["run"]["run_id"] for recs in (first, second) for r in recs if r["type"] == "run"}
    assert ids == {json.loads((resumed / "trackers.json").read_text())["wandb"]["id"]}
    run = next(r["run"] for r in first if r["type"] == "run")
    assert run["project"] == "tether-e2e" and run["job_type"] == "ppo" and run["tags"] == ["e2e"]
    config = {k: v for r in first if r["type"] == "config" for k, v in r["config"].get("update", {}).items()}
    assert config["run.steps"] == 3 and config["run.trackers"] == "['tensorboard', 'wandb', 'mlflow']"
    steps = [[h["_step"] for h in stores.wandb_history(recs)] for recs in (first, second)]
    assert steps == [[0, 1, 2, 3], [4]]
    written, history = rows(resumed), {h["_step"]: h for recs in (first, second) for h in stores.wandb_history(recs)}
    for step in (1, 2, 4):
        for key, value in written[step].items():
            assert history[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (step, key)
    assert history[2]["samples._type"] == "table-file" and history[4]["samples._type"] == "table-file"
    assert history[4]["plots/reward._type"] == "image-file"
    summary = stores.wandb_summary(second)
    assert summary["status"] == "finished" and summary["checkpoint"] == str(resumed / "checkpoints" / "final")
    assert [r["exit"]["exit_code"] for recs in (first, second) for r in recs if r["type"] == "exit"] == [0, 0]


def test_tensorboard_has_every_step_once(resumed):
    acc = stores.tensorboard(resumed)
    assert [s for s, _ in stores.tb_scalar(acc, "kl/beta")] == [1, 2, 3, 4]
    assert [s for s, _ in stores.tb_text(acc, "samples")] == [2, 4]
    assert {"plots/reward", "plots/kl"} <= set(acc.Tags()["images"])
    assert [t for _, t in stores.tb_text(acc, "status")] == ["finished", "finished"]

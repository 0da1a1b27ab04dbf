import json
import math
import re
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from cluster.runtime.observe.metric_set import PER_SOURCE
from cluster.runtime.observe.metrics import METRICS, TAG_KEYS, RayMetrics, RunMetrics, metric_name, progress_line

REPO = Path(__file__).resolve().parents[4]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _strict_loads(line: str):
    def reject(token):
        raise ValueError(f"non-standard JSON constant {token}")
    return json.loads(line, parse_constant=reject)


def _step_metrics(i: int) -> dict:
    return {"reward/mean": 0.1 * i, "reward/std": 0.05 + 0.01 * i, "kl/mean": 0.01 * i ** 1.5,
            "kl/beta": 0.05 / (1 + i), "ppo/clip_frac": 0.1, "perf/step_seconds": 1.5,
            "ppo/explained_variance": float("nan") if i == 1 else 0.5,
            "ppo/grad_norm": np.float32(2.0), "buffer/depth": np.int64(3)}


@pytest.mark.unit
def test_metrics_jsonl_well_formed(tmp_path):
    m = RunMetrics(run_dir=tmp_path, plot_every=0)
    n = 6
    for i in range(n):
        m.log(i, {**_step_metrics(i), "eval/score_mean": float("inf")} if i == 3 else _step_metrics(i))
    m.close()
    m.close()  # idempotent
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == n
    rows = [_strict_loads(line) for line in lines]
    assert [r["step"] for r in rows] == list(range(n))
    assert all(isinstance(r["time"], float) for r in rows)
    assert rows[1]["ppo/explained_variance"] is None and rows[2]["ppo/explained_variance"] == 0.5
    assert rows[3]["eval/score_mean"] is None
    assert rows[4]["ppo/grad_norm"] == 2.0 and rows[4]["buffer/depth"] == 3
    assert rows[2]["reward/mean"] == pytest.approx(0.2)


@pytest.mark.unit
def test_metrics_lines_flushed_before_close(tmp_path):
    m = RunMetrics(run_dir=tmp_path, plot_every=0)
    m.log(1, {"reward/mean": 1.0})
    assert _strict_loads((tmp_path / "metrics.jsonl").read_text())["reward/mean"] == 1.0
    m.close()


@pytest.mark.unit
def test_samples_jsonl_well_formed(tmp_path):
    with RunMetrics(run_dir=tmp_path, plot_every=0) as m:
        m.samples(1, [{"prompt": "Hi \u00e9", "response": "there", "score": 0.5, "kl_sum": 0.01},
                      {"prompt": "x", "response": "y", "score": float("nan"), "kl_sum": np.float64(2.0),
                       "token_kl": np.array([0.1, np.nan])}])
        m.samples(2, [{"prompt": "z", "response": "w", "score": -1.0, "kl_sum": 0.0}])
    rows = [_strict_loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 2]
    assert rows[0]["prompt"] == "Hi \u00e9" and rows[0]["score"] == 0.5
    assert rows[1]["score"] is None and rows[1]["kl_sum"] == 2.0 and rows[1]["token_kl"] == [0.1, None]
    assert all({"prompt", "response", "score", "kl_sum"} <= set(r) for r in rows)


def _read_png(path: Path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    from PIL import Image
    with Image.open(path) as img:
        img.load()
        assert img.size[0] > 100 and img.size[1] > 100
    return data


@pytest.mark.unit
def test_plots_valid_and_change(tmp_path):
    m = RunMetrics(run_dir=tmp_path, plot_every=1)
    plots = tmp_path / "plots"
    m.log(1, _step_metrics(1))
    first = {name: _read_png(plots / name) for name in ("reward.png", "kl.png")}
    assert not (plots / "eval.png").exists()
    m.log(2, _step_metrics(2))
    m.log(3, {**_step_metrics(3), "eval/score_mean": 0.3, "eval/response_len": 12.0})
    for name, before in first.items():
        assert _read_png(plots / name) != before
    eval_before = _read_png(plots / "eval.png")
    m.log(4, _step_metrics(4))
    m.log(5, {**_step_metrics(5), "eval/score_mean": 0.4, "eval/response_len": 15.0})
    assert _read_png(plots / "eval.png") != eval_before
    m.close()
    import matplotlib.image
    assert matplotlib.image.imread(plots / "reward.png").ndim == 3
    assert sorted(p.name for p in plots.iterdir()) == ["eval.png", "kl.png", "reward.png"]  # no temp files


@pytest.mark.unit
def test_plot_every_and_resume(tmp_path):
    m = RunMetrics(run_dir=tmp_path, plot_every=3)
    m.log(1, _step_metrics(1))
    m.log(2, _step_metrics(2))
    assert not (tmp_path / "plots" / "reward.png").exists()
    m.log(3, _step_metrics(3))
    third = _read_png(tmp_path / "plots" / "reward.png")
    m.log(4, _step_metrics(4))
    m.close()  # draws the pending step
    assert _read_png(tmp_path / "plots" / "reward.png") != third
    # A resumed run appends and keeps earlier history in its plots.
    m = RunMetrics(run_dir=tmp_path, plot_every=1)
    assert m.series("reward/mean")[0] == [1, 2, 3, 4]
    m.log(5, _step_metrics(5))
    m.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 5


@pytest.mark.unit
def test_progress_line_full():
    metrics = {"policy/version": 3, "reward/mean": 0.4123, "reward/std": 0.3, "kl/mean": 0.0214,
               "kl/beta": 0.05, "perf/tokens_per_s": 812.4, "perf/step_seconds": 14.2,
               "perf/generate_seconds": 6.1, "perf/score_seconds": 2.0, "perf/learn_seconds": 5.3,
               "perf/sync_seconds": 0.8, "ppo/clip_frac": 0.1}
    line = progress_line(3, 20, metrics, elapsed_s=42.7)
    assert line == ("step 3/20 v3 | reward 0.412±0.30 | kl 0.021 beta 0.050 | 812 tok/s | "
                    "14.2s (gen 6.1 score 2.0 learn 5.3 sync 0.8) | eta 4m02s")


@pytest.mark.unit
def test_progress_line_partial():
    assert progress_line(1, 10, {}, elapsed_s=5.0) == "step 1/10 | eta 45s"
    assert progress_line(10, 10, {"reward/mean": 1.0}, elapsed_s=50.0) == "step 10/10 | reward 1.000"
    line = progress_line(2, 100, {"kl/beta": 0.1, "perf/generate_seconds": 1.25, "eval/score_mean": 0.5,
                                  "note": "text", "none": None}, elapsed_s=3600.0)
    assert line == "step 2/100 | beta 0.100 | eval 0.500 | gen 1.2 | eta 49h00m"
    assert progress_line(0, 0, {"perf/step_seconds": 2.0}, elapsed_s=0.0) == "step 0 | 2.0s"
    assert progress_line(1, 2, {"reward/mean": float("nan")}, 1.0) == "step 1/2 | reward nan | eta 1s"
    assert progress_line(4, 4, {"version": 4}, 9.0) == "step 4/4 v4"  # the driver's plain key works too
    assert progress_line(4, 4, {"rollouts/skipped_prompts": 0}, 9.0) == "step 4/4"
    assert progress_line(4, 4, {"rollouts/skipped_prompts": 3}, 9.0) == \
        "step 4/4 | skipped 3 prompts (too long for the model, or empty)"


@pytest.mark.unit
def test_metric_names():
    assert metric_name("ppo/clip_frac") == "tether_ppo_clip_frac"
    assert metric_name("reward/mean") == "tether_reward_mean"
    for name in METRICS:
        assert re.fullmatch(r"tether_[a-z0-9_]+", name), name
    assert TAG_KEYS["tether_generator_tokens_per_s"] == ("pool", "replica")
    assert TAG_KEYS["tether_score_seconds"] == ("pool", "replica")
    for key in ("reward/mean", "reward/std", "kl/mean", "kl/beta", "ppo/policy_loss", "ppo/value_loss",
                "ppo/entropy", "ppo/clip_frac", "ppo/approx_kl", "ppo/vf_clip_frac",
                "ppo/explained_variance", "ppo/grad_norm", "ppo/lr", "perf/step_seconds",
                "perf/generate_seconds", "perf/score_seconds", "perf/learn_seconds", "perf/sync_seconds",
                "perf/tokens_per_s", "buffer/depth", "buffer/dropped_stale", "buffer/staleness_mean",
                "eval/score_mean", "eval/response_len"):
        assert metric_name(key) in METRICS, key


@pytest.mark.unit
def test_ray_metrics_noop_without_ray(tmp_path, monkeypatch):
    monkeypatch.setattr("ray.is_initialized", lambda: False)  # the shared Ray may be up (tests/rays.py)
    RayMetrics().record({"reward/mean": 1.0}, tags={"pool": "generator"})  # must not raise
    with RunMetrics(run_dir=tmp_path, plot_every=0) as m:
        m.log(1, {"reward/mean": 1.0})


def _grafana():
    return json.loads((REPO / "docs" / "grafana" / "tether-dashboard.json").read_text())


@pytest.mark.unit
def test_grafana_dashboard_matches_metrics():
    dash = _grafana()
    var_names = [v["name"] for v in dash["templating"]["list"]]
    assert "datasource" in var_names
    seen = set()
    for panel in dash["panels"]:
        assert panel["datasource"] == "${datasource}"
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            if "__name__=~" in target["expr"]:  # reward/<source>/mean: its names come from the data
                pattern = re.search(r'__name__=~"ray_([^"]+)"', target["expr"]).group(1)
                assert PER_SOURCE.fullmatch(pattern.replace(".+", "gsm8k")), target["expr"]
                continue
            names = re.findall(r"\b(ray_[a-zA-Z0-9_]+)", target["expr"])
            assert names, target["expr"]
            for name in names:
                assert name.startswith("ray_") and name[4:] in METRICS, (panel["title"], name)
                seen.add(name[4:])
            for tag in re.findall(r"\{\{(\w+)\}\}", target.get("legendFormat", "")):
                assert tag in TAG_KEYS[names[0][4:]], (name, tag)
    assert set(METRICS) - seen == set(), "metrics with no Grafana panel"


@pytest.mark.unit
def test_docs_list_every_metric():
    doc = (REPO / "docs" / "metrics.md").read_text()
    missing = [name for name in METRICS if f"`{name}`" not in doc]
    assert not missing, f"docs/metrics.md lacks {missing}"


# ---------------------------------------------------------------------- live Ray

def _labels(line: str) -> dict:
    return dict(re.findall(r'(\w+)="([^"]*)"', line))


@pytest.fixture(scope="module")
def ray_with_metrics():
    import ray
    import rays
    rays.leave()
    ray.init(address="local", num_cpus=1, include_dashboard=False)
    port = ray.nodes()[0]["MetricsExportPort"]  # Ray's own choice: no port picked here
    yield ray, port
    ray.shutdown()


@pytest.mark.integration
def test_ray_metrics_exported(ray_with_metrics, tmp_path):
    ray, port = ray_with_metrics

    @ray.remote(num_cpus=0)
    class Probe:
        def record(self, replica: str):
            from cluster.runtime.observe.metrics import RayMetrics
            RayMetrics().record({"generator/tokens_per_s": 123.5}, tags={"pool": "generator", "replica": replica})
            RayMetrics().record({"score/seconds": 0.25}, tags={"pool": "reward"})
            return True

    probe = Probe.options(name="generator-0").remote()
    assert ray.get(probe.record.remote("0"))
    ray.kill(probe)
    with RunMetrics(run_dir=tmp_path, plot_every=0) as m:  # the driver path
        m.log(1, {"reward/mean": 0.75, "kl/beta": 0.05, "ppo/explained_variance": float("nan")})
    RayMetrics().record({"buffer/depth": 4}, tags={"pool": "buffer", "replica": "0"})

    wanted = {"ray_tether_reward_mean", "ray_tether_kl_beta", "ray_tether_generator_tokens_per_s",
              "ray_tether_score_seconds", "ray_tether_buffer_depth"}
    found: dict[str, list[str]] = {}  # metric -> its series (an earlier test's may be there too)
    deadline = time.monotonic() + 45
    while time.monotonic() < deadline:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        except OSError:
            text = ""
        # This session's series only: another Ray on the machine may export on a port Ray reused.
        session = f'SessionName="{ray.get_runtime_context().get_session_name()}"'
        found = {}
        for line in text.splitlines():
            if line.startswith("ray_tether_") and session in line:
                found.setdefault(line.split("{")[0], []).append(line)
        if wanted <= set(found):
            break
        time.sleep(1)
    assert wanted <= set(found), f"missing {wanted - set(found)}"

    value = lambda line: float(line.rsplit(" ", 1)[1])
    assert any(value(line) == 0.75 for line in found["ray_tether_reward_mean"])
    assert any(_labels(line)["pool"] == "generator" and _labels(line)["replica"] == "0"
               and math.isclose(value(line), 123.5) for line in found["ray_tether_generator_tokens_per_s"])
    assert any(_labels(line)["pool"] == "reward" and _labels(line)["replica"] == "all"
               and math.isclose(value(line), 0.25) for line in found["ray_tether_score_seconds"])
    depth = [_labels(line) for line in found["ray_tether_buffer_depth"]]
    assert depth and all("pool" not in labels for labels in depth)  # undeclared tags are dropped
    # NaN is never recorded: no series reads NaN (another test may have logged a real value)
    assert not any(math.isnan(value(line)) for line in found.get("ray_tether_ppo_explained_variance", []))


@pytest.mark.integration
# The slow tier: steps must outlast Ray's ~20 s gauge expiry. The default tier:
# tests/e2e/test_observability.py::test_prometheus_exports_the_project_metrics scrapes a live job.
@pytest.mark.slow
def test_ray_gauges_stay_exported_between_slow_steps(ray_with_metrics):
    """Ray drops a gauge ~20 s after its last set(); the keepalive thread must re-set it."""
    ray, port = ray_with_metrics
    RayMetrics().record({"perf/sync_seconds": 1.25})
    t0 = time.monotonic()
    seen_at = []
    while time.monotonic() - t0 < 40:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        except OSError:
            text = ""
        if any(line.startswith("ray_tether_perf_sync_seconds") for line in text.splitlines()):
            seen_at.append(time.monotonic() - t0)
        time.sleep(2)
    assert seen_at, "gauge never exported"
    assert seen_at[-1] > 32, f"gauge vanished from the export after {seen_at[-1]:.0f}s"

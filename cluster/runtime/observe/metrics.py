"""Observability for a run: metrics.jsonl, samples.jsonl, PNG plots, Ray metrics, the progress line.

The driver owns one ``RunMetrics`` and calls ``log(step, metrics)`` once per PPO step with namespaced
keys (``reward/mean``, ``ppo/clip_frac``, ...). Actors that want their own series (tokens/s per
generator, scoring latency per pool) call ``RayMetrics().record(..., tags={"pool": ..., "replica": ...})``.
Every exported name is listed once, in ``METRICS`` (cluster/runtime/observe/metric_set.py); tests check
docs/metrics.md and docs/grafana/tether-dashboard.json against it (add a new metric to a panel there too).
"""
from __future__ import annotations

import io
import json
import logging
import math
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from cluster.runtime.observe.alarms import alarm_words
from cluster.runtime.observe.metric_set import METRICS, PER_SOURCE, PER_SOURCE_MEANING, TAG_KEYS, metric_name
from cluster.runtime.observe.trackers import TrackerSet
from core.infra.files import write_atomic

log = logging.getLogger(__name__)


def _ray_initialized() -> bool:
    ray = sys.modules.get("ray")  # never import ray just to learn it is not running
    return ray is not None and ray.is_initialized()


def _number(v: Any) -> Optional[float]:
    """A finite float, or None for non-numbers and NaN/inf."""
    if hasattr(v, "item") and not isinstance(v, (int, float)):
        try:
            v = v.item()
        except (ValueError, RuntimeError):
            return None
    if isinstance(v, (int, float)) and math.isfinite(v):
        return float(v)
    return None


class RayMetrics:
    """Ray Gauges for ``METRICS``, created lazily once per process; a no-op outside a Ray worker.

    ``record({"generator/tokens_per_s": 812.0}, tags={"pool": "generator", "replica": "0"})``
    sets ``tether_generator_tokens_per_s{pool="generator",replica="0"}`` (Ray exports it as
    ``ray_tether_...``). Tags a metric does not declare are ignored; declared tags that are
    missing read ``"all"``. Non-finite values are skipped (the gauge keeps its last value).
    Keys not in METRICS are still exported, with a one-time warning.
    """

    _gauges: dict[str, Any] = {}
    _lock = threading.Lock()
    _warned: set[str] = set()
    # Ray 2.60 drops a gauge from the Prometheus export ~20 s after its last set(), so steps
    # longer than that would leave gaps: a daemon thread re-sets the last values.
    _last: dict[tuple, float] = {}
    _keepalive: Optional[threading.Thread] = None
    KEEPALIVE_S = 5.0

    def record(self, metrics: dict, tags: Optional[dict] = None) -> None:
        if not _ray_initialized():
            return
        tags = {k: str(v) for k, v in (tags or {}).items()}
        for key, value in metrics.items():
            v = _number(value)
            if v is None:
                continue
            try:
                gauge = self._gauge(metric_name(key), tuple(sorted(tags)))
                full = tuple(sorted((k, tags.get(k, "all")) for k in gauge.info["tag_keys"]))
                gauge.set(v, tags=dict(full))
                with self._lock:
                    self._last[(metric_name(key), full)] = v
            except Exception as e:  # noqa: BLE001 - metrics must never take the run down
                self._warn_once(key, f"could not record Ray metric {key!r}: {e}")
        self._start_keepalive()

    @classmethod
    def _start_keepalive(cls) -> None:
        with cls._lock:
            if cls._keepalive is None or not cls._keepalive.is_alive():
                cls._keepalive = threading.Thread(target=cls._refresh, name="tether-metrics",
                                                  daemon=True)
                cls._keepalive.start()

    @classmethod
    def _refresh(cls) -> None:
        while _ray_initialized():
            time.sleep(cls.KEEPALIVE_S)
            with cls._lock:
                last = list(cls._last.items())
            for (name, tags), value in last:
                try:
                    cls._gauges[name].set(value, tags=dict(tags))
                except Exception:  # noqa: BLE001 - Ray shutting down under us
                    return

    @classmethod
    def _gauge(cls, name: str, unlisted_tags: tuple[str, ...]):
        with cls._lock:
            gauge = cls._gauges.get(name)
            if gauge is None:
                from ray.util.metrics import Gauge
                per_source = name not in METRICS and PER_SOURCE.fullmatch(name)
                if name not in METRICS and not per_source:
                    cls._warn_once(name, f"metric {name} is not listed in cluster.runtime.observe.metrics.METRICS")
                tag_keys = TAG_KEYS.get(name, unlisted_tags)
                meaning = METRICS.get(name, PER_SOURCE_MEANING if per_source else "unlisted")
                gauge = cls._gauges[name] = Gauge(name, meaning, tag_keys=tag_keys)
            return gauge

    @classmethod
    def _warn_once(cls, key: str, msg: str) -> None:
        if key not in cls._warned:
            cls._warned.add(key)
            log.warning(msg)


def _jsonable(obj: Any) -> Any:
    """Plain JSON types; NaN/inf become None (strict parsers reject NaN tokens)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if obj is None or isinstance(obj, (str, bool, int)):
        return obj
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "tolist"):  # numpy arrays/scalars, torch tensors
        return _jsonable(obj.tolist())
    return str(obj)  # paths, enums, ...


def json_line(obj: Any) -> str:
    return json.dumps(_jsonable(obj), allow_nan=False, ensure_ascii=False)


def numbers(metrics: dict) -> dict[str, float]:
    """The finite numbers of a metrics row, as floats: what the experiment trackers get."""
    return {k: v for k, v in ((k, _number(v)) for k, v in metrics.items()) if v is not None}


def _truncate_jsonl(path: Path, step: int) -> None:
    """Keep the rows of ``path`` with step <= ``step``; rewritten atomically."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if int(json.loads(line).get("step", 0)) <= step:
                keep.append(line)
        except ValueError:
            continue  # a torn line
    write_atomic(path, "".join(f"{ln}\n" for ln in keep))


class RunMetrics:
    """metrics.jsonl, samples.jsonl and plots/*.png in ``run_dir``; Ray gauges when Ray is up; the
    same rows, samples and plots to the run's experiment trackers (``trackers``, observe/trackers/).

    Files are appended to, and an existing metrics.jsonl seeds the plots, so a resumed run
    continues its curves.
    """

    PLOTTED = ("reward/mean", "reward/std", "kl/mean", "kl/beta", "eval/score_mean", "eval/response_len")

    def __init__(self, *, run_dir: Path, plot_every: int = 1, trackers: Optional[TrackerSet] = None):
        self.run_dir = Path(run_dir)
        self.plot_dir = self.run_dir / "plots"
        self.plot_dir.mkdir(parents=True, exist_ok=True)
        self.plot_every = plot_every
        self._lock = threading.Lock()
        self._history: dict[str, list[tuple[int, float]]] = {k: [] for k in self.PLOTTED}
        self._seed_history(self.run_dir / "metrics.jsonl")
        self._metrics_f = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")
        self._samples_f = open(self.run_dir / "samples.jsonl", "a", encoding="utf-8")
        self._ray = RayMetrics()
        self._logged = 0
        self._plotted_at = 0
        self._plot_warned = False
        self.trackers = trackers if trackers is not None else TrackerSet(self.run_dir)

    def _seed_history(self, path: Path) -> None:
        if not path.exists():
            return
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a torn last line from a crash
            self._remember(int(row.get("step", 0)), row)

    def _remember(self, step: int, metrics: dict) -> None:
        for key in self.PLOTTED:
            if key in metrics:
                v = _number(metrics[key])
                self._history[key].append((step, math.nan if v is None else v))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        with self._lock:
            self._metrics_f.write(json_line({"step": int(step), "time": time.time(), **metrics}) + "\n")
            self._metrics_f.flush()
            self._remember(int(step), metrics)
            self._logged += 1
            self.trackers.log(int(step), numbers(metrics))
            if self.plot_every and self._logged % self.plot_every == 0:
                self._plot()
        self._ray.record(metrics)

    def rewind(self, step: int) -> None:
        """Forget every row after ``step`` (a resume or rollback redoes those steps), so the
        files keep one row per step; torn lines from a killed process go too."""
        with self._lock:
            for f in (self._metrics_f, self._samples_f):
                f.close()
            for name in ("metrics.jsonl", "samples.jsonl"):
                _truncate_jsonl(self.run_dir / name, step)
            self._history = {k: [] for k in self.PLOTTED}
            self._seed_history(self.run_dir / "metrics.jsonl")
            self._metrics_f = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")
            self._samples_f = open(self.run_dir / "samples.jsonl", "a", encoding="utf-8")
            self.trackers.rewind()

    def samples(self, step: int, rows: list[dict]) -> None:
        with self._lock:
            for row in rows:
                self._samples_f.write(json_line({"step": int(step), **row}) + "\n")
            self._samples_f.flush()
            self.trackers.samples(int(step), [_jsonable(row) for row in rows])

    def close(self, status: str = "finished", checkpoint: Optional[str] = None) -> None:
        """The files closed, the plots drawn a last time, and the trackers told how the run ended
        (finished, stopped; failed is told by the caller's TrackerSet context) and its final checkpoint."""
        with self._lock:
            if self._metrics_f.closed:
                return
            if self.plot_every and self._plotted_at != self._logged:
                self._plot()
            self._metrics_f.close()
            self._samples_f.close()
            plots = {p.stem: p for p in sorted(self.plot_dir.glob("*.png"))}
            self.trackers.finish(status, checkpoint=checkpoint, plots=plots)

    def __enter__(self) -> "RunMetrics":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ plots

    def _plot(self) -> None:
        self._plotted_at = self._logged
        try:
            h = self._history
            if h["reward/mean"]:
                self._draw("reward.png", "reward", "reward/mean", "score mean ± std", band="reward/std")
            if h["kl/mean"] or h["kl/beta"]:
                self._draw("kl.png", "KL and beta", "kl/mean", "KL mean", twin=("kl/beta", "beta"))
            if h["eval/score_mean"]:
                self._draw("eval.png", "eval", "eval/score_mean", "eval score",
                           twin=("eval/response_len", "response length (tokens)"))
        except Exception as e:  # noqa: BLE001 - plots are a convenience; never stop training for them
            if not self._plot_warned:
                self._plot_warned = True
                log.warning("plotting failed (further failures silent): %s", e)

    def _draw(self, filename: str, title: str, key: str, label: str,
              band: Optional[str] = None, twin: Optional[tuple[str, str]] = None) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(7, 4), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        steps, values = self.series(key)
        (line,) = ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=label)
        width = dict(self._history[band]) if band else {}
        if width:
            lo = [v - width.get(s, math.nan) for s, v in zip(steps, values)]
            hi = [v + width.get(s, math.nan) for s, v in zip(steps, values)]
            ax.fill_between(steps, lo, hi, alpha=0.25, color=line.get_color(), linewidth=0)
        ax.set(xlabel="step", ylabel=label, title=title)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if twin and self._history[twin[0]]:
            ax2 = ax.twinx()
            ax2.plot(*self.series(twin[0]), color="tab:orange", linestyle="--", label=twin[1])
            ax2.set_ylabel(twin[1])
            h2, l2 = ax2.get_legend_handles_labels()
            handles, labels = handles + h2, labels + l2
        ax.legend(handles, labels, loc="best", fontsize="small")
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        write_atomic(self.plot_dir / filename, buf.getvalue())

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of a plotted metric, earlier runs of a resumed one included."""
        pts = self._history[key]
        return [s for s, _ in pts], [v for _, v in pts]


# ---------------------------------------------------------------------- progress line

def _duration(seconds: float) -> str:
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def progress_line(step: int, total_steps: int, metrics: dict, elapsed_s: float) -> str:
    """``step 3/20 v3 | reward 0.412±0.30 | kl 0.021 beta 0.050 | 812 tok/s | 14.2s (gen 6.1 ...) | eta 4m02s``.

    ``step`` counts completed steps; keys that are missing are left out.
    """
    m = {}
    for k, v in metrics.items():
        try:
            m[k] = float(v)
        except (TypeError, ValueError):
            pass
    head = f"step {step}/{total_steps}" if total_steps else f"step {step}"
    version = m.get("policy/version", m.get("version"))
    if version is not None and math.isfinite(version):
        head += f" v{int(version)}"
    parts = [head]
    if "reward/mean" in m:
        parts.append(f"reward {m['reward/mean']:.3f}"
                     + (f"±{m['reward/std']:.2f}" if "reward/std" in m else ""))
    kl = [f"{label} {m[k]:.3f}" for k, label in (("kl/mean", "kl"), ("kl/beta", "beta")) if k in m]
    if kl:
        parts.append(" ".join(kl))
    if "eval/score_mean" in m:
        parts.append(f"eval {m['eval/score_mean']:.3f}")
    if "perf/tokens_per_s" in m:
        parts.append(f"{m['perf/tokens_per_s']:.0f} tok/s")
    # the generator's own warning stays in its log (cluster/runtime/observe/console.py)
    if m.get("rollouts/skipped_prompts"):
        parts.append(f"skipped {m['rollouts/skipped_prompts']:.0f} prompts (too long for the model, or empty)")
    phases = " ".join(f"{label} {m[f'perf/{k}_seconds']:.1f}"
                      for k, label in (("generate", "gen"), ("score", "score"), ("learn", "learn"),
                                       ("sync", "sync")) if f"perf/{k}_seconds" in m)
    if "perf/step_seconds" in m:
        parts.append(f"{m['perf/step_seconds']:.1f}s" + (f" ({phases})" if phases else ""))
    elif phases:
        parts.append(phases)
    if total_steps and 0 < step < total_steps and elapsed_s > 0:
        parts.append(f"eta {_duration(elapsed_s / step * (total_steps - step))}")
    if alarm := alarm_words(m):
        parts.append(alarm)
    return " | ".join(parts)

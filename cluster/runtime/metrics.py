"""Observability for a run: metrics.jsonl, samples.jsonl, PNG plots, Ray metrics, the progress line.

The driver owns one ``RunMetrics`` and calls ``log(step, metrics)`` once per PPO step with namespaced
keys (``reward/mean``, ``ppo/clip_frac``, ...). Actors that want their own series (tokens/s per
generator, scoring latency per pool) call ``RayMetrics().record(..., tags={"pool": ..., "replica": ...})``.
Every exported name is listed once, in ``METRICS``; tests check docs/metrics.md and
docs/grafana/tether-dashboard.json against it (add a new metric to a panel there too).
"""
from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

from cluster.runtime.alarms import alarm_words

log = logging.getLogger(__name__)

PREFIX = "tether_"
REPLICA_TAGS = ("pool", "replica")

# key -> (tag keys, one-line meaning). The one place the metric set is defined.
_DEFS: dict[str, tuple[tuple[str, ...], str]] = {
    "reward/mean": ((), "mean sequence score of the step's rollouts (reward model or function)"),
    "reward/std": ((), "standard deviation of the sequence scores in the step"),
    "kl/mean": ((), "mean per-sequence KL(behaviour || reference), summed over response tokens"),
    "kl/beta": ((), "KL penalty coefficient used for this step (fixed or adaptive controller)"),
    "ppo/policy_loss": ((), "clipped PPO policy loss, mean over minibatch updates"),
    "ppo/value_loss": ((), "clipped value loss, mean over minibatch updates"),
    "ppo/ptx_loss": ((), "pretraining (PTX) language-model loss, when ptx_coef > 0"),
    "ppo/kl_loss": ((), "KL-to-reference loss term before beta, mean over minibatch updates (ppo.kl.placement=loss)"),
    "ppo/kl_loss_token_mean": ((), "token-mean of the KL estimator in the loss (ppo.kl.placement=loss)"),
    "ppo/kl_loss_coef": ((), "beta the learner weighed the KL loss term with this step (ppo.kl.placement=loss)"),
    "ppo/entropy": ((), "token-mean entropy of the tempered policy on its own samples"),
    "ppo/clip_frac": ((), "fraction of tokens whose probability ratio was clipped"),
    "ppo/approx_kl": ((), "token-mean KL between the policy before and after the update"),
    "ppo/vf_clip_frac": ((), "fraction of tokens whose value prediction was clipped"),
    "ppo/explained_variance": ((), "1 - Var(returns - values) / Var(returns); 1 is perfect, <0 worse than a constant"),
    "ppo/grad_norm": ((), "gradient norm before clipping, mean over optimiser steps"),
    "ppo/lr": ((), "learning rate at the end of the step"),
    "ppo/logprob_gap_mean": ((), "token-mean |vLLM behaviour logprob - learner logprob| (same weights)"),
    "ppo/logprob_gap_max": ((), "largest |vLLM behaviour logprob - learner logprob| in the batch"),
    "ppo/returns_mean": ((), "token-mean GAE return"),
    "ppo/values_mean": ((), "token-mean value prediction"),
    "eval/gold_score": ((), "mean reward.gold score on the held-out prompts (evaluation only, never trained on)"),
    "alarm/proxy_up_gold_down": ((), "1 when eval/score_mean rose and eval/gold_score fell over the last 3"
                                     " evaluations"),
    "alarm/kl_up_entropy_down": ((), "1 when KL to the reference climbed while entropy collapsed over run.alarm_window"
                                     " steps"),
    "alarm/length_drift": ((), "1 when the response length moved > 50% from its first window's mean"),
    "off_policy/behaviour_kl": ((), "token-mean KL(behaviour || learner at the update's start), k3 estimate"),
    "off_policy/is_weight_mean": ((), "token-mean importance weight pi_learner / pi_behaviour, before the cap"),
    "off_policy/is_weight_max": ((), "largest importance weight pi_learner / pi_behaviour in the batch"),
    "off_policy/capped_frac": ((), "fraction of tokens whose weight exceeds ppo.is_cap (tis truncates, decoupled"
                                   " drops)"),
    "perf/step_seconds": ((), "wall time of the whole PPO step"),
    "perf/generate_seconds": ((), "time spent generating rollouts"),
    "perf/score_seconds": ((), "time spent on reference logprobs and reward scores"),
    "perf/learn_seconds": ((), "time spent in the learner group (PPO epochs)"),
    "perf/sync_seconds": ((), "time to broadcast weights learner -> generators"),
    "perf/sync_wait_seconds": ((), "part of the sync a generator waited for its engine (a generate call, or with"
                                   " partial rollouts one engine step)"),
    "perf/tokens_per_s": ((), "generated response tokens per second over all generators"),
    "perf/buffer_wait_seconds": ((), "time the learner side waited on the RolloutBuffer"),
    "perf/sync_bytes": ((), "bytes broadcast learner -> generators in the weight sync"),
    "perf/learner_seconds": ((), "time of one learner rank's train() call"),
    "perf/learner_group_seconds": ((), "time of the learner group's train(), sharding included"),
    "perf/learner_tokens_per_s": ((), "response tokens per second through the learner"),
    "perf/startup_seconds": ((), "process start to a run ready to step (step 0 only)"),
    **{f"perf/startup_{phase}_seconds": ((), f"start-up phase: {meaning} (step 0 only)") for phase, meaning in (
        ("imports", "interpreter and imports"), ("prepare", "models, tokenizer and data checked"),
        ("ray", "Ray connected or started"), ("pools", "engines and learner ranks loaded"),
        ("other", "run folder and control actor"))},
    "generator/tokens_per_s": (REPLICA_TAGS, "generated tokens per second of one generator replica"),
    "score/seconds": (REPLICA_TAGS, "latency of one scoring call, per pool (reference | reward) and replica"),
    "buffer/depth": ((), "scored rollouts waiting in the RolloutBuffer"),
    "buffer/dropped_stale": ((), "rollouts dropped so far for exceeding max_staleness"),
    "buffer/staleness_mean": ((), "mean policy-version lag of rollouts handed to the learner"),
    "buffer/staleness_max": ((), "largest policy-version lag handed to the learner"),
    "buffer/token_staleness_mean": ((), "mean policy-version lag of the tokens handed to the learner (each token's own"
                                        " version)"),
    "rollouts/partial_frac": ((), "fraction of the batch's rollouts sampled by two or more policy versions (partial"
                                  " rollouts)"),
    "response/length_mean": ((), "mean response length in tokens of the step's rollouts"),
    "response/truncated_frac": ((), "fraction of responses cut at max length"),
    "rollouts/used": ((), "scored rollouts in the step's learner batch"),
    "rollouts/prompts": ((), "prompts sent to the generators for the step"),
    "rollouts/skipped_prompts": ((), "prompts skipped (too long, empty after templating)"),
    "rollouts/invalid_scores": ((), "rollouts dropped because the reward was invalid (NaN, error)"),
    "rollouts/empty_responses": ((), "rollouts with an empty response"),
    "rollouts/duplicate_chunks": ((), "prompt chunks the buffer had stored already (a redispatch that raced its"
                                      " original)"),
    "rollouts/redispatched_chunks": ((), "prompt chunks sent again because the replica holding them died"),
    "eval/score_mean": ((), "mean score on the held-out eval prompts (eval steps only)"),
    "eval/response_len": ((), "mean eval response length in tokens (eval steps only)"),
    "policy/version": ((), "policy version the generators run"),
    "pool/generator_replicas": ((), "live generator replicas (cluster.scale changes it while the job runs)"),
    "pool/reference_replicas": ((), "live reference replicas"),
    "pool/reward_replicas": ((), "live reward replicas"),
    "data/batches_issued": ((), "prompt batches drawn from the data stream so far (its position; a resume continues"
                                " from it)"),
    "learner/step": ((), "learner updates done"),
    "learner/optimizer_steps": ((), "optimiser steps done (DeepSpeed global_steps)"),
    "learner/tokens": ((), "response tokens in the last learner batch"),
    "learner/dropped_rollouts": ((), "rollouts left out of the batch so every learner rank got an equal shard"),
}


def metric_name(key: str) -> str:
    """``ppo/clip_frac`` -> ``tether_ppo_clip_frac`` (Prometheus-safe)."""
    return PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", key).lower()


METRICS: dict[str, str] = {metric_name(k): meaning for k, (_, meaning) in _DEFS.items()}
TAG_KEYS: dict[str, tuple[str, ...]] = {metric_name(k): tags for k, (tags, _) in _DEFS.items()}


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
                if name not in METRICS:
                    cls._warn_once(name, f"metric {name} is not listed in cluster.runtime.metrics.METRICS")
                tag_keys = TAG_KEYS.get(name, unlisted_tags)
                gauge = cls._gauges[name] = Gauge(name, METRICS.get(name, "unlisted"), tag_keys=tag_keys)
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
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(f"{ln}\n" for ln in keep), encoding="utf-8")
    tmp.replace(path)


class RunMetrics:
    """metrics.jsonl, samples.jsonl and plots/*.png in ``run_dir``; Ray gauges when Ray is up.

    Files are appended to, and an existing metrics.jsonl seeds the plots, so a resumed run
    continues its curves.
    """

    PLOTTED = ("reward/mean", "reward/std", "kl/mean", "kl/beta", "eval/score_mean", "eval/response_len")

    def __init__(self, *, run_dir: Path, plot_every: int = 1, tensorboard: bool = False):
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
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise RuntimeError("tensorboard=True needs the `tensorboard` package "
                                   "(pip install tensorboard)") from e
            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

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
            if self._tb is not None:
                for key, value in metrics.items():
                    v = _number(value)
                    if v is not None:
                        self._tb.add_scalar(key, v, int(step))
                self._tb.flush()
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

    def samples(self, step: int, rows: list[dict]) -> None:
        with self._lock:
            for row in rows:
                self._samples_f.write(json_line({"step": int(step), **row}) + "\n")
            self._samples_f.flush()

    def close(self) -> None:
        with self._lock:
            if self._metrics_f.closed:
                return
            if self.plot_every and self._plotted_at != self._logged:
                self._plot()
            self._metrics_f.close()
            self._samples_f.close()
            if self._tb is not None:
                self._tb.close()

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
        steps, values = self._series(key)
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
            ax2.plot(*self._series(twin[0]), color="tab:orange", linestyle="--", label=twin[1])
            ax2.set_ylabel(twin[1])
            h2, l2 = ax2.get_legend_handles_labels()
            handles, labels = handles + h2, labels + l2
        ax.legend(handles, labels, loc="best", fontsize="small")
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        fd, tmp = tempfile.mkstemp(dir=self.plot_dir, prefix=f".{filename}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(buf.getvalue())
            os.chmod(tmp, 0o644)  # mkstemp makes 0600; plots are for everyone who can read the run
            os.replace(tmp, self.plot_dir / filename)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _series(self, key: str) -> tuple[list[int], list[float]]:
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
    if m.get("rollouts/skipped_prompts"):  # the generator's own warning stays in its log (cluster/runtime/console.py)
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

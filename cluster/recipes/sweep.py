"""The KL-coefficient sweep:
python -m cluster.sweep [--config configs/pipeline-cpu.yaml] [--betas 0 0.05 0.5] [key=value ...]

Reruns the PPO stage of a pipeline run folder (cluster/recipes/pipeline.py; the folder is the
config's run.dir/run.name) once per beta, with the folder's SFT model and proxy reward
model, a fixed KL coefficient (ppo.kl.target=null) and the gold score on the held-out
prompts. Writes under ``<pipeline folder>/sweep/``: ``beta-<b>/`` (a PPO run folder each),
``sweep.png`` (proxy reward, gold score and KL against step, one line per beta, shared
axes) and ``samples.md`` (each beta's samples at its last sampled step). A beta whose run
folder already succeeded is reused, not rerun: delete the folder to redo it.
"""
from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

from cluster.config.pipeline import PipelineConfig, linked_rl
from cluster.job.errors import UserError
from cluster.recipes.pipeline import stage_dirs, with_trackers
from cluster.recipes.stage import resolve_base

log = logging.getLogger("tether")
DEFAULT_BETAS = (0.0, 0.05, 0.5)
PANELS = (("reward/mean", "proxy reward (reward/mean)"), ("eval/gold_score", "gold score, held-out prompts"),
          ("kl/mean", "KL to the SFT model (kl/mean)"))
SAMPLES_SHOWN = 6
SMOOTH = 5  # steps in the running mean drawn over the per-step proxy reward and KL


def split_betas(argv: list[str]) -> tuple[list[float], list[str]]:
    """(betas, the other arguments): ``--betas`` takes the numbers that follow it."""
    if "--betas" not in argv:
        return list(DEFAULT_BETAS), argv
    at = argv.index("--betas")
    end = at + 1
    while end < len(argv) and _number(argv[end]) is not None:
        end += 1
    betas = [_number(a) for a in argv[at + 1:end]]
    if not betas or min(betas) < 0:
        raise UserError(f"--betas needs one or more KL coefficients >= 0, e.g. --betas 0 0.05 0.5 (got "
                        f"{' '.join(argv[at + 1:end + 1]) or 'nothing'})")
    return betas, argv[:at] + argv[end:]


def _number(text: str):
    try:
        return float(text)
    except ValueError:
        return None


def run_dirname(beta: float) -> str:
    return f"beta-{beta:g}"


def sweep(cfg: PipelineConfig, betas: list[float]) -> str:
    from cluster.config.ppo import validate
    from cluster.job.startup import connect_ray
    from cluster.runtime import service

    if cfg.run.name is None:
        raise UserError("run.name must name the pipeline run folder to sweep (e.g. run.name=pipeline-cpu)")
    root = Path(cfg.run.dir) / cfg.run.name
    dirs = stage_dirs(root)
    if not root.is_dir():
        raise UserError(f"{root} does not exist; run python -m cluster.pipeline with this config first")
    sft_final, rm_final = resolve_base(str(dirs["sft"])), resolve_base(str(dirs["rm"]))
    out = root / "sweep"
    out.mkdir(exist_ok=True)
    connect_ray(cfg.rl)
    for beta in betas:
        run_dir = out / run_dirname(beta)
        if _state(run_dir) == "succeeded":
            log.info("sweep: beta=%g already ran (%s); reusing it", beta, run_dir)
            continue
        if run_dir.exists():
            raise UserError(f"{run_dir} holds an unfinished run; delete it to rerun beta={beta:g}")
        rl = linked_rl(cfg.rl, policy=sft_final, reward_model=rm_final, gold=cfg.pairs.gold, run_dir=str(out),
                       name=run_dirname(beta))
        rl = replace(with_trackers(rl, cfg, root), ppo=replace(rl.ppo, kl=replace(rl.ppo.kl, beta=beta, target=None)))
        validate(rl)
        log.info("sweep: PPO at fixed beta=%g -> %s", beta, run_dir)
        service.run(rl)
    histories = {b: read_jsonl(out / run_dirname(b) / "metrics.jsonl") for b in betas}
    plot(histories, out / "sweep.png")
    table = samples_table({b: read_jsonl(out / run_dirname(b) / "samples.jsonl") for b in betas})
    (out / "samples.md").write_text(table)
    print(last_step_table(histories) + "\n\n" + table)
    return f"plot {out / 'sweep.png'}; samples {out / 'samples.md'}"


def _state(run_dir: Path):
    try:
        return json.loads((run_dir / "status.json").read_text()).get("state")
    except (OSError, ValueError):
        return None


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that carry ``key`` with a number (NaN is written as null)."""
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [s for s, _ in pts], [v for _, v in pts]


def plot(histories: dict, path: Path) -> None:
    """One figure, one panel per PANELS key, one line per beta, shared step axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 3.8), dpi=75)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(PANELS), sharex=True)
    for ax, (key, title) in zip(axes, PANELS):
        for i, (beta, rows) in enumerate(histories.items()):
            steps, values = series(rows, key)
            color = f"C{i}"
            if key == "eval/gold_score":  # evaluated every few steps: the points themselves
                ax.plot(steps, values, marker=".", color=color, label=f"beta={beta:g}")
                continue
            # per-step values are noisy (64 rollouts): faint, with a SMOOTH-step running mean on top
            ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
            ax.plot(steps, running_mean(values, SMOOTH), color=color, label=f"beta={beta:g}")
        ax.set_title(title + ("" if key == "eval/gold_score" else f", {SMOOTH}-step mean"), fontsize=10)
        ax.set_xlabel("PPO step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def running_mean(values: list[float], window: int) -> list[float]:
    """Mean of each value and the up to ``window - 1`` before it."""
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]


def last_values(rows: list[dict]) -> dict:
    return {key: (series(rows, key)[1] or [float("nan")])[-1] for key, _ in PANELS}


def last_step_table(histories: dict) -> str:
    lines = ["| beta | proxy reward | gold score | KL |", "|---|---|---|---|"]
    for beta, rows in histories.items():
        v = last_values(rows)
        lines.append(f"| {beta:g} | {v['reward/mean']:.3f} | {v['eval/gold_score']:.3f} | {v['kl/mean']:.3f} |")
    return "\n".join(lines)


def samples_table(samples: dict) -> str:
    """Markdown: for each beta, SAMPLES_SHOWN samples of its last sampled step."""
    lines = ["| beta | step | prompt | response | proxy score |", "|---|---|---|---|---|"]
    for beta, rows in samples.items():
        if not rows:
            continue
        last = max(r["step"] for r in rows)
        for r in [r for r in rows if r["step"] == last][:SAMPLES_SHOWN]:
            cell = lambda s: str(s).replace("|", "\\|").replace("\n", " ").strip()
            score = r.get("score")
            lines.append(f"| {beta:g} | {last} | {cell(r['prompt'])} | {cell(r['response'])} | "
                         f"{'' if score is None else f'{score:.2f}'} |")
    return "\n".join(lines) + "\n"

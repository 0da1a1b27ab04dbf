"""Advantage estimators compared: reward (and gold) per rollout and per wall-second, GAE with
a critic against the critic-free family.

    .venv/bin/python -m bench.estimators                          # default task, 3 seeds x 5 variants
    .venv/bin/python -m bench.estimators --task gold --pipeline runs/pipeline-cpu --steps 80
    .venv/bin/python -m bench.estimators --variants gae-shared lora-r8 lora-r32   # LoRA against full

Each variant is a real `python -m cluster.train` run with every seed (sampling, data, learner)
set to the same number, one after another (seeds outermost, so a drifting machine touches
every variant alike):

    gae-shared     ppo.advantage=gae, the value head on the policy (the shipped default)
    gae-separate   gae with a separate critic initialised from a reward-model body
    grpo           group-normalised returns, k3 KL in the loss (as GRPO is published)
    rloo           leave-one-out baseline, k1 KL in the reward
    reinforce_pp   batch-whitened returns-to-go, k1 KL in the reward
    lora-r8        gae-shared training a rank-8 LoRA adapter (learner.lora) instead of every weight
    lora-r32       the same at rank 32

``--task default``: configs/tiny-cpu.yaml (the built-in sentiment reward; the separate critic
starts from the pre-trained tiny policy's body, since there is no reward model). ``--task gold``:
the PPO stage of a finished `python -m cluster.pipeline` folder, rerun from its own config
(SFT policy, proxy reward model, gold score on held-out prompts; the critic from the proxy).
Prints one table (mean +- std over seeds) and writes a JSON record and a plot: reward against
rollouts trained on and against wall seconds (and, on the gold task, the eval prompts' gold
and proxy scores against the step). Wall time is the runs' own step times, so the machine
should be quiet. ``--reuse`` redraws the table and plot from runs already in ``--out``.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

GRPO = ["ppo.advantage=grpo", "ppo.kl.placement=loss", "ppo.kl.estimator=k3"]
VARIANTS = {  # name -> overrides ({critic}: the separate critic's starting checkpoint)
    "gae-shared": [],
    "gae-separate": ["learner.critic=separate", "learner.critic_model={critic}"],
    "grpo": GRPO,
    "rloo": ["ppo.advantage=rloo"],
    "reinforce_pp": ["ppo.advantage=reinforce_pp"],
    # LoRA on every linear layer (gae, shared head), at 10x the full fine-tune's lr of configs/tiny-cpu.yaml
    "lora-r8": ["learner.lora.rank=8", "learner.optim.lr=2e-3"],
    "lora-r32": ["learner.lora.rank=32", "learner.optim.lr=2e-3"],
}
LAST = 5  # steps averaged for "reward reached"


def task_setup(args) -> tuple[list[str], str]:
    """(the overrides that pick the task, the separate critic's checkpoint)."""
    if args.task == "default":
        from cluster.demo.pretrain import build_pretrained_policy
        return [], str(build_pretrained_policy())
    if args.pipeline is None:
        raise SystemExit("bench.estimators: --task gold needs --pipeline, a finished cluster.pipeline folder")
    from cluster.recipes.stage import resolve_base
    config = args.pipeline / "ppo" / "config.yaml"
    if not config.is_file():
        raise SystemExit(f"bench.estimators: {config} is missing; run python -m cluster.pipeline first")
    return ["--config", str(config)], resolve_base(str(args.pipeline / "rm"))


def run_one(name: str, seed: int, args, task: list[str], critic: str) -> dict:
    run = f"{name}-s{seed}"
    if args.reuse and _finished(args.out / run, args.steps):
        return summarise(name, seed, args.out / run, wall_s=np.nan)
    overrides = [o.format(critic=critic) for o in VARIANTS[name]] + [
        f"run.steps={args.steps}", f"run.seed={seed}", f"data.seed={seed}", f"generator.sampling.seed={seed}",
        f"run.dir={args.out}", f"run.name={run}", "run.plot_every=0", "run.checkpoint_every=0",
        f"run.eval_every={args.eval_every or args.steps}", *args.set]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "cluster.train", *task, *overrides], capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"bench.estimators: {run} failed (exit {proc.returncode}): {last}")
    return summarise(name, seed, args.out / run, wall_s=time.perf_counter() - t0)


def _finished(run_dir: Path, steps: int) -> bool:
    try:
        status = json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return False
    return status.get("state") == "succeeded" and status.get("steps") == steps


def summarise(name: str, seed: int, run_dir: Path, wall_s: float) -> dict:
    """One run's figures from its metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0 and "reward/mean" in r]
    get = lambda key: np.array([r.get(key) if r.get(key) is not None else np.nan for r in steps], dtype=float)  # noqa: E731
    reward, seconds = get("reward/mean"), np.nancumsum(get("perf/step_seconds"))
    evals = [(r["step"], r.get("eval/score_mean"), r.get("eval/gold_score")) for r in rows if "eval/score_mean" in r]
    gain = float(np.nanmean(reward[-LAST:]) - np.nanmean(reward[:3]))
    used = get("rollouts/used")
    return {"variant": name, "seed": seed, "wall_s": wall_s, "evals": evals,
            "reward": reward.tolist(), "seconds": seconds.tolist(), "rollouts": np.nancumsum(used).tolist(),
            "reward_last": float(np.nanmean(reward[-LAST:])), "eval_final": evals[-1][1] if evals else np.nan,
            "gold_final": evals[-1][2] if evals and evals[-1][2] is not None else np.nan,
            "kl_last": float(np.nanmean(get("kl/mean")[-LAST:])),
            "step_s": float(np.nanmean(get("perf/step_seconds"))),
            "learn_s": float(np.nanmean(get("perf/learn_seconds"))),
            "gain_per_100s": 100 * gain / float(seconds[-1]),
            "gain_per_1k_rollouts": 1000 * gain / float(np.nansum(used))}


COLUMNS = ["reward_last", "eval_final", "gold_final", "kl_last", "gain_per_1k_rollouts", "gain_per_100s",
           "step_s", "learn_s"]


def table(results: list[dict]) -> str:
    cols = [c for c in COLUMNS if not all(np.isnan(r[c]) for r in results)]
    lines = ["| variant | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name in VARIANTS:
        mine = [r for r in results if r["variant"] == name]
        if mine:
            cells = [_cell(np.array([r[c] for r in mine], dtype=float)) for c in cols]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(v: np.ndarray) -> str:
    return f"{np.nanmean(v):.3g} ± {np.nanstd(v):.2g}" if len(v) > 1 else f"{v[0]:.3g}"


def plot(results: list[dict], path: Path) -> None:
    """Reward against rollouts and against seconds; with a gold score, a third panel: the
    eval prompts' gold (solid) and proxy (dashed) scores against the step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gold = any(e[2] is not None for r in results for e in r["evals"])
    fig, axes = plt.subplots(1, 3 if gold else 2, figsize=(16 if gold else 11, 4))
    for name in VARIANTS:
        mine = [r for r in results if r["variant"] == name]
        if not mine:
            continue
        n = min(len(r["reward"]) for r in mine)
        reward, rollouts, seconds = (np.nanmean([r[k][:n] for r in mine], axis=0)
                                     for k in ("reward", "rollouts", "seconds"))
        line, = axes[0].plot(rollouts, reward, label=name)
        axes[1].plot(seconds, reward, label=name)
        if gold:
            steps = [e[0] for e in mine[0]["evals"]]
            axes[2].plot(steps, _eval_curve(mine, 2), color=line.get_color(), label=f"{name} gold")
            axes[2].plot(steps, _eval_curve(mine, 1), color=line.get_color(), linestyle="--")
    axes[0].set_xlabel("rollouts trained on")
    axes[1].set_xlabel("wall seconds of the steps")
    axes[0].set_ylabel("reward/mean (mean over seeds)")
    axes[1].sharey(axes[0])
    axes[1].legend()
    if gold:
        axes[2].set_xlabel("step")
        axes[2].set_ylabel("eval: gold (solid), proxy (dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _eval_curve(runs: list[dict], column: int) -> np.ndarray:
    """Mean over seeds of one eval column (1: proxy score, 2: gold score) at each eval step."""
    return np.nanmean([[np.nan if e[column] is None else e[column] for e in r["evals"]] for r in runs], axis=0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.estimators", description=__doc__.split("\n")[0])
    ap.add_argument("--task", choices=["default", "gold"], default="default")
    ap.add_argument("--pipeline", type=Path, help="--task gold: a finished cluster.pipeline run folder")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--eval-every", type=int, default=0, help="0: evaluate at the last step only")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS)[:5], choices=list(VARIANTS),
                    help="default: the five estimators; --variants gae-shared lora-r8 lora-r32 compares LoRA")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="more cluster.train overrides for every run, e.g. model.dtype=float32")
    ap.add_argument("--out", type=Path, default=Path("runs/bench-estimators"))
    ap.add_argument("--reuse", action="store_true",
                    help="summarise a run already finished in --out (same name and steps) instead of rerunning it")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    task, critic = task_setup(args)
    results = []
    for seed in args.seeds:
        for name in args.variants:
            results.append(run_one(name, seed, args, task, critic))
            r = results[-1]
            print(f"{name} seed {seed}: reward last {r['reward_last']:.3f}, eval {r['eval_final']:.3f}, "
                  f"gold {r['gold_final']:.3f}, step {r['step_s']:.2f}s, {r['wall_s']:.0f}s", flush=True)
    print(table(results))
    record = args.out / f"estimators-{args.task}.json"
    record.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1))
    plot(results, args.out / f"estimators-{args.task}.png")
    print(f"record: {record}; plot: {args.out / f'estimators-{args.task}.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

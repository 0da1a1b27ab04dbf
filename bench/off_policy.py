"""Off-policy correction benchmark: reward reached per rollout trained on, async vs sync, at
each precision.

    .venv/bin/python -m bench.off_policy                       # 3 seeds x (sync, async x none/tis/decoupled)
    .venv/bin/python -m bench.off_policy --seeds 0 1 --steps 20 --staleness 4 --set learner.optim.lr=6e-4
    .venv/bin/python -m bench.off_policy --dtypes float32 bfloat16 --variants sync sync-none async-tis \
        --steps 40 --staleness 1                                # bf16 sampling against the learner

Each variant is a real `python -m cluster.train` run of the default task (configs/tiny-cpu.yaml)
with every seed (sampling, data, learner) set to the same number. Every step trains on the same
number of rollouts in both modes, so comparing reward by step compares reward per rollout
consumed. Prints one table (mean +- std over seeds) and writes a JSON record and a plot of
the mean reward curves. Learning, not speed, is measured: a busy machine only changes how
stale async rollouts get (reported as staleness), not the comparison's meaning.
"""
from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

VARIANTS = {  # name -> overrides
    "sync": ["run.mode=sync"],
    "sync-none": ["run.mode=sync", "ppo.off_policy=none"],  # no correction for sampler/learner numerics
    "async-none": ["run.mode=async", "ppo.off_policy=none"],
    "async-tis": ["run.mode=async", "ppo.off_policy=tis"],
    "async-decoupled": ["run.mode=async", "ppo.off_policy=decoupled"],
}
DTYPES = ("float32", "bfloat16")
LAST = 5  # steps averaged for "reward reached"


def run_one(name: str, dtype: str, seed: int, args, out: Path) -> dict:
    run = f"{name}-{dtype}-s{seed}"
    overrides = VARIANTS[name] + [f"model.dtype={dtype}",
        f"run.steps={args.steps}", f"run.seed={seed}", f"data.seed={seed}", f"generator.sampling.seed={seed}",
        f"buffer.max_staleness={args.staleness}", f"ppo.is_cap={args.is_cap}", f"run.dir={out}",
        f"run.name={run}", "run.plot_every=0", "run.checkpoint_every=0", f"run.eval_every={args.steps}",
        *args.set]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "cluster.train", *overrides], capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"bench.off_policy: {run} failed (exit {proc.returncode}): {last}")
    rows = [json.loads(line) for line in (out / run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    get = lambda key: np.array([r.get(key) if r.get(key) is not None else np.nan for r in steps], dtype=float)
    reward = get("reward/mean")
    evals = [r["eval/score_mean"] for r in rows if r.get("eval/score_mean") is not None]
    return {"variant": name, "dtype": dtype, "seed": seed, "wall_s": time.perf_counter() - t0,
            "reward": reward.tolist(),
            "reward_last": float(np.nanmean(reward[-LAST:])), "reward_auc": float(np.nanmean(reward)),
            "eval_final": evals[-1] if evals else float("nan"),
            "rollouts_used": float(np.nansum(get("rollouts/used"))),
            "dropped_stale": float(np.nanmax(get("buffer/dropped_stale"), initial=0)),
            "staleness_mean": float(np.nanmean(get("buffer/staleness_mean"))),
            "behaviour_kl": float(np.nanmean(get("off_policy/behaviour_kl"))),
            "is_weight_max": float(np.nanmax(get("off_policy/is_weight_max"))),
            "capped_frac": float(np.nanmean(get("off_policy/capped_frac"))),
            "is_weight_mean": float(np.nanmean(get("off_policy/is_weight_mean"))),
            "logprob_gap_mean": float(np.nanmean(get("ppo/logprob_gap_mean"))),
            "kl_last": float(np.nanmean(get("kl/mean")[-LAST:]))}


def table(results: list[dict]) -> str:
    cols = ["reward_last", "reward_auc", "eval_final", "kl_last", "staleness_mean", "logprob_gap_mean",
            "behaviour_kl", "is_weight_mean", "is_weight_max", "capped_frac", "dropped_stale", "wall_s"]
    lines = ["| variant | dtype | " + " | ".join(cols) + " |", "|---" * (len(cols) + 2) + "|"]
    for name, dtype in itertools.product(VARIANTS, DTYPES):
        mine = [r for r in results if (r["variant"], r["dtype"]) == (name, dtype)]
        if not mine:
            continue
        cells = []
        for c in cols:
            v = np.array([r[c] for r in mine], dtype=float)
            cells.append(f"{np.nanmean(v):.3g} ± {np.nanstd(v):.2g}" if len(v) > 1 else f"{v[0]:.3g}")
        lines.append(f"| {name} | {dtype} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, dtype in itertools.product(VARIANTS, DTYPES):
        curves = [r["reward"] for r in results if (r["variant"], r["dtype"]) == (name, dtype)]
        if curves:
            n = min(map(len, curves))
            ax.plot(np.arange(1, n + 1), np.nanmean([c[:n] for c in curves], axis=0), label=f"{name} {dtype}")
    ax.set_xlabel("PPO step (64 rollouts trained on each)")
    ax.set_ylabel("reward/mean (mean over seeds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.off_policy", description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--staleness", type=int, default=2, help="buffer.max_staleness of the async runs")
    ap.add_argument("--is-cap", type=float, default=2.0)
    ap.add_argument("--variants", nargs="+", default=[v for v in VARIANTS if v != "sync-none"],
                    choices=list(VARIANTS))
    ap.add_argument("--dtypes", nargs="+", default=["float32"], choices=DTYPES,
                    help="model.dtype of the runs: each variant runs at each")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="more cluster.train overrides for every run, e.g. learner.optim.lr=6e-4")
    ap.add_argument("--out", type=Path, default=Path("runs/bench-off-policy"))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in args.seeds:  # seeds outermost: a drifting machine affects every variant alike
        for name, dtype in itertools.product(args.variants, args.dtypes):
            results.append(run_one(name, dtype, seed, args, args.out))
            r = results[-1]
            print(f"{name} {dtype} seed {seed}: reward last {r['reward_last']:.3f}, auc {r['reward_auc']:.3f}, "
                  f"staleness {r['staleness_mean']:.2f}, {r['wall_s']:.0f}s", flush=True)
    print(table(results))
    (args.out / "off_policy.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                          "results": results}, indent=1))
    plot(results, args.out / "off_policy.png")
    print(f"record: {args.out / 'off_policy.json'}; plot: {args.out / 'off_policy.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

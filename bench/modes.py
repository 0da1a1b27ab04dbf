"""Async against sync mode on the tether-vs-TRL benchmark workload (bench/workload.py, ~30M preset), at equal rollouts.

    .venv/bin/python -m bench.modes                         # 1 warm-up + 4 timed steps per mode
    .venv/bin/python -m bench.modes --steps 1 --prompts 8 --new-tokens 8   # smoke

Runs tether on bench.vs_trl's workload (configs/bench-30m.yaml, shared value head, as
shipped) once per mode: sync, async (buffer.max_staleness 1, partial rollouts as shipped)
and async with partial rollouts off (every weight push waits for a whole generate call),
and prints the throughput of each: rollouts trained per second over the timed steps (the
first step warms up), the median step and where it goes (sync-wait: the part of the push
spent waiting for a generator's engine; partial: the fraction of trained rollouts two
versions sampled), and the ratios to sync. The record goes to runs/bench/modes.json.
Figures mean something only on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench.vs_trl import ROOT, BenchError, run_command, tether_command

MODES = {"sync": ["run.mode=sync"], "async": ["run.mode=async", "buffer.max_staleness=1"],
         "async-whole": ["run.mode=async", "buffer.max_staleness=1", "generator.partial_rollouts=false"]}


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m bench.modes", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4, help="timed PPO steps per mode, after one warm-up step")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--critic", choices=("shared", "separate"), default="shared")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="model.dtype of every run")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    ap.add_argument("--out", default="runs/bench/modes.json")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.new_tokens < 1 or args.prompts < 4 or args.prompts % 4:
        ap.exit(2, "python -m bench.modes: error: --steps and --new-tokens must be >= 1, --prompts a multiple of 4\n")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or "sync" not in args.modes or len(args.modes) < 2:
        ap.exit(2, f"python -m bench.modes: error: --modes must name sync and at least one of "
                   f"{', '.join(m for m in MODES if m != 'sync')} (got {','.join(args.modes)})\n")
    return args


def run_mode(wl: dict, args, mode: str, run_dir: Path) -> dict:
    cmd = tether_command(wl, args, args.critic, {}, 1 + args.steps, run_dir) + MODES[mode]
    _, mem, wall = run_command(cmd, {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}, mode)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [m for m in lines if m["step"] >= 1]
    timed = steps[1:]
    seconds = timed[-1]["time"] - steps[0]["time"]  # wall clock from the end of the warm-up step
    phases = {p: statistics.median(m.get(f"perf/{p}_seconds", 0.0) for m in timed)
              for p in ("step", "generate", "score", "learn", "sync", "sync_wait", "buffer_wait")}
    phases["partial_frac"] = statistics.median(m.get("rollouts/partial_frac", 0.0) for m in timed)
    return {"rollouts_per_s": sum(m["rollouts/used"] for m in timed) / seconds, "seconds": seconds,
            "median": phases, "steps": len(timed), "wall_seconds": wall,
            "startup_seconds": lines[0].get("perf/startup_seconds"), "run_dir": str(run_dir)}


def main(argv=None) -> int:
    args = parse_args(argv)
    from bench.workload import build_workload

    wl = json.loads(build_workload(prompts=max(256, 4 * args.prompts)).read_text())
    load_before = os.getloadavg()
    if load_before[0] > 0.5:
        print(f"bench: load average {load_before[0]:.2f} (> 0.5): the figures are not meaningful", file=sys.stderr)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        result = {mode: run_mode(wl, args, mode, ROOT / "runs" / "bench" / f"modes-{stamp}-{mode}")
                  for mode in args.modes}
    except BenchError as e:
        print(str(e), file=sys.stderr)
        return e.code
    rows = [f"{'':12}{'rollouts/s':>11}{'step s':>8}{'gen':>7}{'score':>7}{'learn':>7}{'sync':>7}"
            f"{'sync-wait':>10}{'buf-wait':>9}{'partial':>8}"]
    for mode, r in result.items():
        m = r["median"]
        rows.append(f"{mode:12}{r['rollouts_per_s']:11.3f}{m['step']:8.1f}{m['generate']:7.1f}{m['score']:7.1f}"
                    f"{m['learn']:7.1f}{m['sync']:7.2f}{m['sync_wait']:10.2f}{m['buffer_wait']:9.1f}"
                    f"{m['partial_frac']:8.2f}")
    sync = result["sync"]["rollouts_per_s"]
    ratios = {mode: r["rollouts_per_s"] / sync for mode, r in result.items() if mode != "sync"}
    ratio = ratios.get("async", next(iter(ratios.values())))
    rows += [f"{mode}/sync throughput: {x:.2f}x" for mode, x in ratios.items()]
    rows.append(f"({args.steps} timed steps each, critic={args.critic}, {args.dtype})")
    text = "\n".join(rows)
    print(text)
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"time": stamp, "load_before": load_before, "load_after": os.getloadavg(),
                               "args": vars(args), "modes": result, "ratio": ratio, "ratios": ratios,
                               "report": text}, indent=1))
    print(f"record: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

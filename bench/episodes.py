"""Multi-turn episodes against single-turn generation on one generator, at the same token budget.

    .venv/bin/python -m bench.episodes [--prompts 32] [--n 4] [--turns 4] [--budget 96] [--step-ms 0] [--workers 2]
                                       [--block-sizes 128,32]

One in-process Generator (as a generator actor runs it on CPU) with the pre-trained tiny
policy, whose turns end at EOS. The same prompts, ``--n`` samples each, are played two ways:
  - single-turn: one response each, at most ``--budget`` tokens (``generate``);
  - episodes: up to ``--turns`` turns each against an environment that answers every turn
    with a short observation (``--step-ms`` of work per step), at most ``--budget`` response
    tokens per episode, observations included (``env.max_tokens``), in ``--workers`` processes;
    played in lockstep rounds, then continuously (env.schedule).
Each side runs on an engine of its own in a fresh process, one after the other.
``--block-sizes``: each side again on an engine with each KV block size (generator.engine.block_size;
the prefix cache keeps whole blocks), to compare them in one run.
Each side: a warm-up call, then ``--repeats`` timed calls. Prints rollouts (episodes) per
second, the policy's tokens per second, turns per episode, and the share of the episodes'
wall time spent waiting on the environments; writes runs/bench/episodes.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.episodes", description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4, help="samples (episodes) per prompt")
    ap.add_argument("--turns", type=int, default=4, help="env.max_turns")
    ap.add_argument("--budget", type=int, default=96, help="response tokens per rollout (env.max_tokens)")
    ap.add_argument("--step-ms", type=float, default=0.0, help="each environment step's work, in ms")
    ap.add_argument("--workers", type=int, default=2, help="env.workers: environment processes")
    ap.add_argument("--block-sizes", default="", help="comma-separated KV block sizes to run each side at "
                    "(default: the engine's default only)")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per side, after one warm-up")
    ap.add_argument("--out", default="runs/bench/episodes.json")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # SIDE@BLOCK: one side, in this process
    return ap.parse_args(argv)


def side(generator, prompts, repeats: int) -> dict:
    """Median figures of ``repeats`` generate calls after a warm-up."""
    generator.generate(prompts)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = generator.generate(prompts)
        seconds = time.perf_counter() - t0
        counts = dict(result.summary.episode_counts)
        runs.append({"seconds": seconds, "rollouts_per_s": len(result.rollouts) / seconds,
                     "policy_tokens_per_s": result.summary.generated_tokens / seconds,
                     "turns_mean": counts["turns"] / counts["episodes"] if counts else 1.0,
                     "env_share": counts.get("step_seconds", 0.0) / seconds})
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


SIDES = ("single-turn", "rounds", "continuous")
RESULT = "bench.episodes side: "  # the line a side's process prints its figures on


def one_side(args, name: str, block_size: int) -> dict:
    """One side on an engine of its own, in this process (``--one``)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, as a generator actor runs it
    os.environ["TETHER_BENCH_STEP_MS"] = str(args.step_ms)
    sys.path.insert(0, str(HERE))  # bench/episode_env.py, for the environment workers too
    from transformers import AutoTokenizer

    from actors.environments.config import EnvConfig
    from actors.generator import Generator
    from cluster.demo.pretrain import build_pretrained_policy
    from cluster.demo.sentiment import builtin_prompts

    policy = str(build_pretrained_policy())
    tok = AutoTokenizer.from_pretrained(policy)
    prompts = [tok(t)["input_ids"] for t in builtin_prompts(args.prompts)]
    sampling = {"temperature": 1.0, "max_new_tokens": args.budget, "n": args.n, "seed": 0}
    engine = {"max_model_len": 256, "kv_cache_bytes": 64 << 20, "block_size": block_size or None}
    env = dict(environment="episode_env:Echo", max_turns=args.turns, max_tokens=args.budget,
               max_turn_tokens=args.budget, workers=args.workers, step_timeout_s=30.0)
    kwargs = {} if name == "single-turn" else {
        "env": EnvConfig(**env, schedule="continuous" if name == "continuous" else "rounds")}
    generator = Generator(model=policy, sampling=sampling, engine=engine, **kwargs)
    try:
        return side(generator, prompts, args.repeats)
    finally:
        if generator.episodes is not None:
            generator.episodes.close()


def in_own_process(argv: list[str], name: str, block_size: int) -> dict:
    """``one_side`` in a fresh interpreter: an engine left behind by an earlier side keeps its
    thread's OpenMP team, which slows the next engine's kernels (core/modeling/engine_thread.py)."""
    out = subprocess.run([sys.executable, "-m", "bench.episodes", *argv, "--one", f"{name}@{block_size}"],
                         capture_output=True, text=True, cwd=HERE.parent, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith(RESULT)]
    if out.returncode or not lines:
        raise SystemExit(f"bench.episodes: the {name} side failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT):])


def report(args, figures: dict, sizes: list[int]) -> dict:
    """Prints the sides' figures -> each episodes side's policy tokens/s over single-turn's."""
    print(f"{args.prompts} prompts x {args.n}, budget {args.budget} tokens, up to {args.turns} turns, "
          f"environment step {args.step_ms:g} ms in {args.workers} workers")
    print(f"{'side':16s} {'seconds':>8s} {'rollouts/s':>11s} {'policy tok/s':>13s} {'turns':>6s} {'env share':>10s}")
    for name, f in figures.items():
        print(f"{name:16s} {f['seconds']:8.2f} {f['rollouts_per_s']:11.1f} {f['policy_tokens_per_s']:13.0f} "
              f"{f['turns_mean']:6.2f} {f['env_share']:10.3f}")
    ratios = {}
    for at in (f"@{size}" if size else "" for size in sizes):
        single = figures["single-turn" + at]["policy_tokens_per_s"]
        for name in SIDES[1:]:
            ratios[name + at] = figures[name + at]["policy_tokens_per_s"] / single
    print("episodes' policy tokens/s over single-turn: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    return ratios


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.one:
        name, block_size = args.one.split("@")
        print(RESULT + json.dumps(one_side(args, name, int(block_size))), flush=True)
        return 0
    from bench.learner import write_record
    from cluster.demo.pretrain import build_pretrained_policy

    build_pretrained_policy()  # once, before the sides share its cache
    sizes = [int(b) for b in args.block_sizes.split(",")] if args.block_sizes else [0]
    figures = {}
    for size in sizes:
        at = f"@{size}" if size else ""
        for name in SIDES:
            figures[name + at] = in_own_process(argv, name, size)
    ratios = report(args, figures, sizes)
    write_record(args.out, {"args": vars(args), **figures, "policy_tokens_per_s_ratio": ratios})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

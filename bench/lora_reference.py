"""What the reference costs with a LoRA adapter: a reference pool against `reference.on_learner`.

    .venv/bin/python -m bench.lora_reference                      # the workload's 31.7M policy
    .venv/bin/python -m bench.lora_reference --policy-size mid    # a 0.17B random-weight one

Two real `python -m cluster.train` runs of the vs-TRL workload (configs/bench-30m.yaml, shared
value head, rank-8 adapter), one after the other: the reference scored by its own pool (a second
copy of the base model in an actor of its own), then by learner rank 0 with its adapter switched
off (no reference actor). The process tree's peak RSS is read by role (bench/procmem.py), so the
table shows what the reference actor held, what the learner held, and the whole tree; the KL
columns show the two runs score the same reference.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

from bench.vs_trl import BenchError, run_tether

SIDES = {"reference pool": [], "reference.on_learner": ["reference.on_learner=true"]}


def parse_args(argv):
    from bench.sizes import SIZES

    ap = argparse.ArgumentParser(prog="python -m bench.lora_reference", description=__doc__.split("\n")[0])
    ap.add_argument("--policy-size", choices=tuple(SIZES), default="bench")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default="runs/bench/lora_reference")
    return ap.parse_args(argv)


def one_side(wl: dict, args, name: str) -> dict:
    run_dir = Path(args.out) / name.replace(" ", "-").replace(".", "-")
    shutil.rmtree(run_dir, ignore_errors=True)  # the bench's own folder: each run starts afresh
    extra = [f"learner.lora.rank={args.rank}", "learner.optim.lr=1e-4", *SIDES[name]]
    bench_args = SimpleNamespace(prompts=args.prompts, new_tokens=args.new_tokens, dtype=args.dtype)
    result = run_tether(wl, bench_args, "shared", {}, args.steps, run_dir, extra=extra)
    memory = result["memory"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    kl = [r["kl/mean"] for r in rows if r["step"] > 0 and "kl/mean" in r]
    return {"side": name, "memory": memory, "kl": kl,
            "score_s": statistics.median(s["score_seconds"] for s in result["steps"]),
            "reference_rss": memory.get("Reference", {}).get("peak_rss_bytes", 0),
            "learner_rss": memory.get("LearnerWorker", {}).get("peak_rss_bytes", 0),
            "total_rss": sum(m["peak_rss_bytes"] for m in memory.values())}


def table(results: list[dict]) -> str:
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    lines = ["| reference | reference actor peak RSS | learner peak RSS | whole tree | score s | KL by step |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['side']} | {gib(r['reference_rss']) if r['reference_rss'] else 'none'} | "
                     f"{gib(r['learner_rss'])} | {gib(r['total_rss'])} | {r['score_s']:.2f} | "
                     f"{', '.join(f'{k:.5f}' for k in r['kl'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from bench.sizes import sized_workload
    from bench.workload import build_workload

    args = parse_args(argv)
    wl = sized_workload(json.loads(build_workload().read_text()), args.policy_size, with_value=True)
    try:
        results = [one_side(wl, args, name) for name in SIDES]
    except BenchError as e:
        raise SystemExit(str(e)) from None
    print(f"policy {args.policy_size}, {args.dtype}, LoRA rank {args.rank}, {args.prompts} prompts x "
          f"{args.new_tokens} tokens, {args.steps} steps")
    print(table(results))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "lora_reference.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

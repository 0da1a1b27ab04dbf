"""Scores/s of one judge reward replica (reward.judge): the tiny judge's vLLM engine in this
process, as a CPU reward actor hosts it, scoring batches of the demo's (prompt, response) pairs.

    .venv/bin/python -m bench.judge                     # 64 pairs per call, bf16, 5 timed calls
    .venv/bin/python -m bench.judge --pairs 8 --repeats 1 --dtype float32

Each call renders the template, tokenizes, generates greedily (the verdict " 0"/" 1" and EOS,
at most --max-new-tokens) and parses; the time is the whole score_texts call. Prints start-up,
scores/s (median call) and the share of valid verdicts; writes runs/bench/judge.json. Figures
mean something only on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.judge", description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = ap.parse_args(argv)
    from actors.generator import engine_process_env
    os.environ.update({**engine_process_env(num_gpus=0, tensor_parallel=1), "OMP_NUM_THREADS": str(args.threads),
                       "VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    from actors.rewards.config import DEFAULT_TEMPLATE, JudgeConfig
    from actors.rewards.judge import JudgeScorer
    from cluster.demo.judge import build_judge, judge_rows
    from core.modeling.engine_config import EngineConfig

    rows = judge_rows(args.pairs, seed=7)
    prompts, responses = [r[0] for r in rows], [r[1] for r in rows]
    t0 = time.perf_counter()
    judge = JudgeScorer(JudgeConfig(model=str(build_judge()), template=DEFAULT_TEMPLATE,
                                    max_new_tokens=args.max_new_tokens,
                                    engine=EngineConfig(dtype=args.dtype, kv_cache_bytes=64 << 20)))
    start = time.perf_counter() - t0
    judge.score_texts(prompts, responses, {})  # warm-up
    seconds, valid = [], 0
    for _ in range(args.repeats):
        t = time.perf_counter()
        res = judge.score_texts(prompts, responses, {})
        seconds.append(time.perf_counter() - t)
        valid = int(res.valid.sum())
    out = {"pairs": args.pairs, "dtype": judge.dtype, "threads": args.threads, "startup_s": round(start, 2),
           "call_s": round(statistics.median(seconds), 4),
           "scores_per_s": round(args.pairs / statistics.median(seconds), 1), "valid": f"{valid}/{args.pairs}"}
    print(json.dumps(out))
    path = ROOT / "runs" / "bench" / "judge.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()

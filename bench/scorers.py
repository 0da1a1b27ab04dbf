"""The reference and the reward model scoring one step's rollouts, packed against padded.

    .venv/bin/python -m bench.scorers [--ragged] [--rollouts 64] [--repeats 3] [--dtype float32]

Both scorers run in this process, as a replica runs them (16 sequences per forward, chunks
sorted by length): ``Reference.reference_logprobs`` on the 31.7M policy of bench.workload
and ``Reward.score_rollouts`` on its reward model of the same shape, each with
``packing`` on and off, on the same rollouts (bench.learner's: ``--new-tokens`` each, or
--ragged: responses of 8-256 tokens ending at EOS, prompts of 8-128). Prints each side's
median seconds over ``--repeats`` calls after one warm-up, the tokens it fed the model,
and the packed side's speed-up; the two sides' outputs must agree (fp32: 1e-4).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from bench.learner import rollouts, write_record


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.scorers", description=__doc__.split("\n")[0])
    ap.add_argument("--rollouts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--ragged", action="store_true", help="responses of 8-256 tokens ending at EOS, prompts of 8-128")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per side, after one warm-up")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default="runs/bench/scorers.json")
    return ap.parse_args(argv)


def timed(call, repeats: int) -> tuple[float, object]:
    """(median seconds of ``repeats`` calls after a warm-up, the last call's output)."""
    out = call()
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = call()
        seconds.append(time.perf_counter() - t0)
    return float(np.median(seconds)), out


def fed_tokens(batch: list, role: str, packing: bool, batch_size: int = 16) -> int:
    """Positions the forwards run on: real tokens packed; padded, each chunk's width (the
    reference's prompt | response layout, the reward model's right-padded rows)."""
    from core.modeling.loading import length_sorted_chunks

    lengths = [r.prompt_ids.size + r.response_ids.size for r in batch]
    if packing:
        return int(sum(lengths))
    total = 0
    for chunk in length_sorted_chunks(lengths, batch_size):
        if role == "reference":
            width = max(batch[i].prompt_ids.size for i in chunk) + max(batch[i].response_ids.size for i in chunk)
        else:
            width = max(lengths[i] for i in chunk)
        total += len(chunk) * width
    return total


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(args.threads)
    from actors.reference import Reference
    from actors.reward import Reward
    from actors.rewards.config import RewardConfig
    from bench.workload import build_workload

    wl = json.loads(build_workload().read_text())
    batch = rollouts(wl, args.rollouts, args.new_tokens, args.ragged)
    record = {"rollouts": args.rollouts, "ragged": args.ragged, "dtype": args.dtype, "threads": args.threads,
              "prompt_tokens": float(np.mean([r.prompt_ids.size for r in batch])),
              "response_tokens": float(np.mean([r.response_ids.size for r in batch]))}
    print(f"scorers bench: {args.rollouts} rollouts, {record['prompt_tokens']:.0f} prompt + "
          f"{record['response_tokens']:.0f} response tokens on average, {args.dtype}, {args.threads} threads")
    outputs = {}
    for role, make, call in (
            ("reference", lambda p: Reference(model=wl["reference"], dtype=args.dtype, packing=p, device="cpu"),
             lambda s: np.concatenate(s.reference_logprobs(batch))),
            ("reward", lambda p: Reward(config=RewardConfig(model=wl["reward"], function=None, packing=p),
                                        dtype=args.dtype, device="cpu"),
             lambda s: s.score_rollouts(batch).scores)):
        for packing in (False, True):
            side = f"{role}-{'packed' if packing else 'padded'}"
            scorer = make(packing)
            seconds, outputs[side] = timed(lambda s=scorer, c=call: c(s), args.repeats)
            record[side] = {"median_s": seconds, "fed_tokens": fed_tokens(batch, role, packing)}
            print(f"  {side:18s} {seconds:7.3f} s  fed {record[side]['fed_tokens']:6d} tokens")
        gap = float(np.abs(outputs[f"{role}-packed"] - outputs[f"{role}-padded"]).max())
        speedup = record[f"{role}-padded"]["median_s"] / record[f"{role}-packed"]["median_s"]
        record[role] = {"speedup": speedup, "max_gap": gap}
        print(f"  {role}: packed {speedup:.2f}x padded's speed; outputs agree to {gap:.1e}")
        if args.dtype == "float32" and gap > 1e-4:
            raise SystemExit(f"bench.scorers: {role} packed and padded outputs differ by {gap:.1e}")
    write_record(args.out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

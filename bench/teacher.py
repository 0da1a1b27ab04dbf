"""What a teacher costs the reference replicas: one step's rollouts scored by the reference
alone, by the reference and a teacher of the same size (a second model), and by the reference
serving as its own teacher (scored once).

    .venv/bin/python -m bench.teacher [--rollouts 64] [--new-tokens 128] [--repeats 3] [--dtype bfloat16]

Every side is a reference replica as a run builds it (actors/reference.py, packing on, 16
sequences a forward) on the 31.7M workload of bench.workload, in this process, called as the
dispatcher calls it (``reference_logprobs_pulled``) on the same rollouts. Prints each side's
median seconds after one warm-up and its ratio to the reference alone.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch

from bench.learner import rollouts, write_record
from bench.scorers import timed


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.teacher", description=__doc__.split("\n")[0])
    ap.add_argument("--rollouts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per side, after one warm-up")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default="runs/bench/teacher.json")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    import json

    args = parse_args(argv)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(args.threads)
    from actors.reference import Reference
    from bench.workload import build_workload

    wl = json.loads(build_workload().read_text())
    batch = rollouts(wl, args.rollouts, args.new_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        other = shutil.copytree(wl["reference"], os.path.join(tmp, "teacher"))  # same size, loaded apart
        sides = (("reference alone", None), ("reference + teacher", other),
                 ("reference as teacher", wl["reference"]))
        record = {"rollouts": args.rollouts, "new_tokens": args.new_tokens, "dtype": args.dtype,
                  "threads": args.threads}
        print(f"teacher bench: {args.rollouts} rollouts x {args.new_tokens} tokens, {args.dtype}, "
              f"{args.threads} threads")
        for name, teacher in sides:
            replica = Reference(model=wl["reference"], dtype=args.dtype, device="cpu", teacher=teacher)
            seconds, _ = timed(lambda r=replica: r.reference_logprobs_pulled(batch), args.repeats)
            record[name] = seconds
            print(f"  {name:22s} {seconds:7.3f} s  {seconds / record['reference alone']:.2f}x the reference alone")
            del replica
    write_record(args.out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

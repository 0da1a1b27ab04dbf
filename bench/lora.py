"""LoRA against full-parameter training, side by side: the push, the learner's update, its memory.

    .venv/bin/python -m bench.lora                                  # the workload's 31.7M policy, bf16
    .venv/bin/python -m bench.lora --policy-size mid --dtype float32
    .venv/bin/python -m bench.lora --rollouts 8 --new-tokens 8 --repeats 1    # smoke

Each side runs in a process of its own (so its peak RSS is its own), one after the other:

  - full: learner.lora.rank=0, every parameter trains and every push carries the whole LM;
  - lora-r<R>: an adapter of rank R on every linear layer (--ranks), the base frozen.

A side builds one learner rank (DeepSpeed ZeRO, shared value head, as a run uses it), runs a
warm-up update and --repeats timed ones on the same scored rollouts (bench/learner.py's), reads
its peak RSS, writes a resumable checkpoint and sizes it, then starts a vLLM generator in the
same process and times --repeats pushes into it: the learner's side (gathering, serialising)
and the generator's (reloading the weights, or loading the adapter and proving it). Ray's object
store, which carries the bytes in a run, is left out: both sides would pay it per byte. Prints
one table and writes runs/bench/lora.json.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path


def parse_args(argv):
    from bench.sizes import SIZES

    ap = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument("--policy-size", choices=tuple(SIZES), default="bench")
    ap.add_argument("--rollouts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--zero", type=int, default=2, choices=(0, 1, 2, 3))
    ap.add_argument("--side", help=argparse.SUPPRESS)  # internal: run one side in this process
    ap.add_argument("--out", default="runs/bench/lora.json")
    return ap.parse_args(argv)


def learner_config(args, rank: int) -> dict:
    mb = args.rollouts // 4
    lr = 1e-5 if rank == 0 else 1e-4
    return {"zero_stage": args.zero, "critic": "shared", "dtype": args.dtype, "lora": {"rank": rank},
            "optim": {"lr": lr, "warmup_steps": 0, "decay": "constant", "grad_clip": 0.0},
            "ppo": {"ppo_epochs": 2, "minibatch_size": mb, "micro_batch_size": mb}}


def push_payload(worker):
    """What the learner sends and the generator call that takes it: (seconds to build it, bytes, call)."""
    from learner.transport.base import policy_weights, to_buckets

    t0 = time.perf_counter()
    module = worker.engine.module
    if module.lora is None:
        buckets = to_buckets(policy_weights(worker.named_weights(), tied_embeddings=worker.tied_embeddings))
        return time.perf_counter() - t0, sum(map(len, buckets)), lambda gen, v: gen.load_weights(v, buckets)
    files, _ = worker.exporter.adapter_files()
    return time.perf_counter() - t0, sum(map(len, files.values())), lambda gen, v: gen.load_adapter(v, files)


def one_side(args, rank: int) -> dict:
    """Runs in its own process: the learner's update and peak RSS, then the pushes into a generator."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, as a generator actor runs it
    from bench.learner import rollouts
    from bench.sizes import sized_workload
    from bench.workload import build_workload
    from learner.worker import LearnerWorker

    wl = sized_workload(json.loads(build_workload().read_text()), args.policy_size,
                        with_value=False)
    batch = rollouts(wl, args.rollouts, args.new_tokens)
    worker = LearnerWorker(rank=0, world_size=1, model=wl["policy"], config=learner_config(args, rank))
    health = worker.health()
    worker.train(batch)  # warm-up
    learn = [worker.train(batch)["perf/learner_seconds"] for _ in range(args.repeats)]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    checkpoint = checkpoint_bytes(worker)
    from actors.generator import Generator
    gen = Generator(model=wl["policy"], engine={"max_model_len": 256, "kv_cache_bytes": 32 << 20,
                                                "dtype": args.dtype, "max_lora_rank": rank and max(rank, 8)})
    build, received, push_bytes = [], [], 0
    for version in range(1, args.repeats + 1):
        seconds, push_bytes, call = push_payload(worker)
        report = call(gen, version)
        build.append(seconds)
        received.append(report["seconds"])
    return {"side": "full" if rank == 0 else f"lora-r{rank}", "trainable": health["trainable_parameters"],
            "parameters": health["parameters"], "learn_s": statistics.median(learn), "peak_rss": rss,
            "push_bytes": push_bytes, "push_build_s": statistics.median(build),
            "push_load_s": statistics.median(received), "checkpoint_bytes": checkpoint}


def checkpoint_bytes(worker) -> int:
    """Bytes of the resumable checkpoint the learner writes (weights that train, optimizer state)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        worker.save(tmp)
        return sum(f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file())


def table(results: list[dict]) -> str:
    full = next((r for r in results if r["side"] == "full"), results[0])
    lines = ["| side | trainable | push bytes | vs full | push s (learner + generator) | learner step s | vs full | "
             "learner peak RSS | checkpoint |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['side']} | {r['trainable'] / 1e6:.2f}M of {r['parameters'] / 1e6:.1f}M | "
                     f"{r['push_bytes'] / 1e6:.2f} MB | {r['push_bytes'] / full['push_bytes']:.1%} | "
                     f"{r['push_build_s']:.3f} + {r['push_load_s']:.3f} | {r['learn_s']:.2f} | "
                     f"{r['learn_s'] / full['learn_s']:.2f}x | {r['peak_rss'] / 2**30:.2f} GiB | "
                     f"{r['checkpoint_bytes'] / 1e6:.1f} MB |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.side is not None:
        print("RESULT " + json.dumps(one_side(args, int(args.side))), flush=True)
        return 0
    results = []
    for rank in [0, *args.ranks]:
        cmd = [sys.executable, "-m", "bench.lora", *(argv if argv is not None else sys.argv[1:]), "--side", str(rank)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            raise SystemExit(f"bench.lora: side rank={rank} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        results.append(json.loads(line[len("RESULT "):]))
        print(f"{results[-1]['side']}: done", flush=True)
    print(f"policy {args.policy_size}, {args.dtype}, ZeRO-{args.zero}, {args.rollouts} rollouts x "
          f"{args.new_tokens} tokens, median of {args.repeats}")
    print(table(results))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tokens/s of one tether generator replica against a bare vllm.LLM.

    .venv/bin/python -m bench.generation                          # 64 prompts x 128 tokens
    .venv/bin/python -m bench.generation --prompts 4 --new-tokens 8 --repeats 1   # smoke
    .venv/bin/python -m bench.generation --dtype bfloat16        # every side in bf16

Same model (the workload's 31.7M policy), engine settings, sampling parameters (per-prompt
seeds, logprobs of the sampled token, no EOS stop) and prompts on every side:
  - bare: vllm.LLM(...).generate in a child process, no Ray, no tether code around it;
  - tether: actors.generator.Generator as a Ray actor (as cluster/runtime/pools/pool.py starts it), timed
    from this process around `sample` with num_returns=2, as the driver calls it;
  - HF: transformers' generate on the same batch, for reference (no KV-cache paging);
  - bare with vLLM's own process layout (engine core and worker in two more processes,
    the same unbound threads), for reference.
The bare and tether sides run vLLM as a tether generator actor does on CPU: --cpus unbound
threads, the engine in the calling process (actors.generator.engine_process_env).
Each side: start-up, a warm-up call, then --repeats timed calls. Prints tokens/s, the
tether/bare ratio, start-up and peak RSS (process plus its helpers, bench/procmem.py),
and writes runs/bench/generation.json. Figures mean something only on a quiet machine.
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

from bench.procmem import PeakMemory

ROOT = Path(__file__).resolve().parent.parent
KV_CACHE_BYTES = 256 << 20


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m bench.generation", description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per side, after one warm-up call")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the weights' and activations' dtype on every side")
    ap.add_argument("--cpus", type=int, default=os.cpu_count() or 1, help="threads / Ray CPUs each side gets")
    ap.add_argument("--no-hf", action="store_true", help="skip the Hugging Face generate reference")
    ap.add_argument("--no-vllm-processes", action="store_true",
                    help="skip the bare vLLM run with vLLM's own process layout")
    ap.add_argument("--out", default="runs/bench/generation.json")
    ap.add_argument("--child", choices=("vllm", "hf"), help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if min(args.prompts, args.new_tokens, args.repeats, args.cpus) < 1:
        ap.exit(2, "python -m bench.generation: error: --prompts, --new-tokens, --repeats and --cpus must be >= 1\n")
    return args


def settings(wl: dict, args) -> tuple[dict, dict]:
    """(sampling, engine): the tether Generator's configs, which the bare side mirrors."""
    length = wl["prompt_tokens"] + args.new_tokens
    sampling = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": args.new_tokens, "n": 1,
                "seed": 0, "ignore_eos": True}
    engine = {"max_model_len": 1 << (length - 1).bit_length(), "kv_cache_bytes": KV_CACHE_BYTES,
              "max_num_seqs": args.prompts, "dtype": args.dtype}
    return sampling, engine


def timed_calls(call, repeats: int) -> list[dict]:
    """One warm-up call, then `repeats` timed ones: [{"seconds", "tokens"}]."""
    call()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokens = call()
        out.append({"seconds": time.perf_counter() - t0, "tokens": tokens})
    return out


# ---------------------------------------------------------------------------- children
def child_vllm(wl: dict, prompts: list, args) -> dict:
    """A bare vllm.LLM with the engine arguments actors/generator.py passes on CPU (less
    tether's weight-reload worker extension, which does nothing while generating)."""
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from actors.generation import request_seed
    from core.modeling.engine_config import EngineConfig, SamplingConfig

    sampling, engine = settings(wl, args)
    s, e = SamplingConfig(**sampling), EngineConfig(**engine)
    llm = LLM(model=wl["policy"], dtype=e.dtype, max_model_len=e.max_model_len, max_num_seqs=e.max_num_seqs,
              enforce_eager=e.enforce_eager, seed=s.seed, logprobs_mode="processed_logprobs",
              kv_cache_memory_bytes=e.kv_cache_bytes)
    startup = time.perf_counter() - t0
    params = [SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_new_tokens,
                             n=s.n, logprobs=0, ignore_eos=s.ignore_eos, seed=request_seed(s.seed, 0, i))
              for i in range(len(prompts))]
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def call():
        outs = llm.generate(inputs, params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    return {"startup_seconds": startup, "calls": timed_calls(call, args.repeats)}


def child_hf(wl: dict, prompts: list, args) -> dict:
    t0 = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.cpus)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(wl["policy"], dtype=getattr(torch, args.dtype)).eval()
    model.generation_config.eos_token_id = None  # no EOS stop: fixed length, like ignore_eos
    startup = time.perf_counter() - t0
    ids = torch.tensor(prompts)  # every prompt has the same length: no padding

    def call():
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, max_new_tokens=args.new_tokens, min_new_tokens=0,
                                 pad_token_id=wl["pad_token_id"])
        return int(out[:, ids.shape[1]:].numel())

    return {"startup_seconds": startup, "calls": timed_calls(call, args.repeats)}


def run_child(kind: str, wl_path: Path, args, vllm_processes: bool = False) -> dict:
    """``vllm_processes``: vLLM's own process layout (engine core and worker in processes of
    their own); otherwise as a tether generator actor runs it on CPU (engine_process_env).
    Either way the worker gets --cpus unbound threads (cluster/runtime/pools/threads.py)."""
    from actors.generator import engine_process_env
    from cluster.runtime.pools.threads import thread_env

    cmd = [sys.executable, "-m", "bench.generation", "--child", kind, "--workload", str(wl_path),
           "--prompts", str(args.prompts), "--new-tokens", str(args.new_tokens),
           "--repeats", str(args.repeats), "--cpus", str(args.cpus), "--dtype", args.dtype]
    threads = thread_env(args.cpus, vllm=kind == "vllm")
    if kind == "vllm" and not vllm_processes:
        threads.update(engine_process_env(num_gpus=0, tensor_parallel=1))
    env = {**os.environ, **threads, "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    with PeakMemory(proc.pid, root_label=kind) as mem:
        out = proc.stdout.read()
        code = proc.wait()
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if code or not lines:
        raise SystemExit(f"bench.generation: the {kind} side failed (exit {code}); its log is above")
    return {**json.loads(lines[-1]), "peak_rss_bytes": mem.by_role().get(kind, {}).get("peak_rss_bytes", 0)}


# ---------------------------------------------------------------------------- tether side
def run_tether(wl: dict, prompts: list, args) -> dict:
    import numpy as np
    import ray

    from actors.generator import actor_class, engine_process_env
    from cluster.runtime.pools.pool import QUIET_ENV
    from cluster.runtime.pools.threads import thread_env

    sampling, engine = settings(wl, args)
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, logging_level="WARNING")
    try:
        t0 = time.perf_counter()
        # as cluster/runtime/pools/pool.py starts it in sync mode
        env = {**QUIET_ENV, **thread_env(args.cpus, vllm=True),
               **engine_process_env(num_gpus=0, tensor_parallel=1)}
        gen = actor_class().options(name="bench-generator", num_cpus=args.cpus,
                                    runtime_env={"env_vars": env}).remote(
            model=wl["policy"], sampling=sampling, engine=engine, name="bench-generator")
        pid = ray.get(gen.health.remote())["pid"]
        startup = time.perf_counter() - t0
        ids, idx = [np.asarray(p, dtype=np.int64) for p in prompts], list(range(len(prompts)))

        def call():
            _, summary = gen.sample.options(num_returns=2).remote(ids, idx)
            return ray.get(summary).generated_tokens

        with PeakMemory(pid, root_label="Generator") as mem:
            calls = timed_calls(call, args.repeats)
        peak = mem.by_role().get("Generator", {}).get("peak_rss_bytes", 0)
        return {"startup_seconds": startup, "calls": calls, "peak_rss_bytes": peak}
    finally:
        ray.shutdown()


def summary(side: dict) -> dict:
    tps = [c["tokens"] / c["seconds"] for c in side["calls"]]
    return {"tokens_per_s": statistics.median(tps),
            "seconds_per_call": statistics.median(c["seconds"] for c in side["calls"]),
            "tokens_per_call": side["calls"][0]["tokens"], "startup_seconds": side["startup_seconds"],
            "peak_rss_bytes": side["peak_rss_bytes"]}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        wl = json.loads(Path(args.workload).read_text())
        prompts = wl["prompt_ids"][:args.prompts]
        result = (child_vllm if args.child == "vllm" else child_hf)(wl, prompts, args)
        print(json.dumps(result), flush=True)
        return 0
    from bench.workload import build_workload

    wl_path = build_workload(prompts=max(256, args.prompts))
    wl = json.loads(wl_path.read_text())
    prompts = wl["prompt_ids"][:args.prompts]
    load_before = os.getloadavg()
    if load_before[0] > 0.5:
        print(f"bench: load average {load_before[0]:.2f} (> 0.5): the figures are not meaningful", file=sys.stderr)
    sides = {"bare vllm.LLM": run_child("vllm", wl_path, args), "tether Generator": run_tether(wl, prompts, args)}
    if not args.no_vllm_processes:
        sides["bare, vLLM processes"] = run_child("vllm", wl_path, args, vllm_processes=True)
    if not args.no_hf:
        sides["HF generate"] = run_child("hf", wl_path, args)
    table = {name: summary(side) for name, side in sides.items()}
    rows = [f"{'':20}{'tokens/s':>10}{'s/call':>9}{'tokens':>8}{'start s':>9}{'peak RSS MiB':>14}"]
    for name, s in table.items():
        rows.append(f"{name:20}{s['tokens_per_s']:10.0f}{s['seconds_per_call']:9.2f}{s['tokens_per_call']:8d}"
                    f"{s['startup_seconds']:9.1f}{s['peak_rss_bytes'] / 2**20:14.0f}")
    ratio = table["tether Generator"]["tokens_per_s"] / table["bare vllm.LLM"]["tokens_per_s"]
    rows.append(f"ratio tether/bare tokens/s: {ratio:.3f} ({args.dtype}, {args.prompts} prompts x "
                f"{args.new_tokens} tokens, "
                f"{args.cpus} CPUs each, median of {args.repeats})")
    text = "\n".join(rows)
    print(text)
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"time": time.strftime("%Y%m%d-%H%M%S"), "cpus": os.cpu_count(),
                               "load_before": load_before, "load_after": os.getloadavg(),
                               "args": {k: v for k, v in vars(args).items() if k not in ("child", "workload")},
                               "summary": table, "runs": sides, "ratio_tether_over_bare": ratio, "report": text},
                              indent=1))
    print(f"record: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

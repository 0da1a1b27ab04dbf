"""vLLM's CPU generation with and without a LoRA adapter, side by side.

    .venv/bin/python -m bench.lora_generation                      # 64 prompts x 128 tokens, bf16
    .venv/bin/python -m bench.lora_generation --prompts 4 --new-tokens 8 --repeats 1   # smoke

Three sides, each a vllm.LLM in a child process of its own (in-process engine, as a generator
actor runs it on CPU), on the workload's 31.7M policy with the same prompts and seeds:
  - plain: no LoRA;
  - enabled: enable_lora=True, no adapter in the requests;
  - adapter: a rank-``--rank`` adapter on every linear layer (PEFT, random B) in every request.
Each side: a warm-up call, then ``--repeats`` timed calls; prints tokens/s, the ratio to plain,
and with ``--profile`` the adapter side's top ops by self CPU time.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SIDES = ("plain", "enabled", "adapter")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.lora_generation", description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="profile one adapter call (torch.profiler)")
    ap.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # a child's side
    return ap.parse_args(argv)


def adapter_dir(policy: str, rank: int) -> Path:
    """A rank-``rank`` adapter on every linear layer of ``policy``, made once."""
    from cluster.demo.tiny_models import cache_root

    out = cache_root() / f"bench-lora-adapter-r{rank}-{Path(policy).name}"
    if not (out / "adapter_config.json").exists():
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(policy)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights=False)
        get_peft_model(model, config).save_pretrained(out)
    return out


def child(args) -> dict:
    """One side, timed in this process."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from bench.workload import build_workload

    wl = json.loads(build_workload(prompts=max(256, args.prompts)).read_text())
    kw = dict(model=wl["policy"], dtype=args.dtype, max_model_len=256, max_num_seqs=args.prompts, seed=0,
              kv_cache_memory_bytes=256 << 20, enable_chunked_prefill=False, max_num_batched_tokens=4096)
    if args.side != "plain":
        kw.update(enable_lora=True, max_lora_rank=args.rank, max_loras=1)
    request = LoRARequest("bench", 1, str(adapter_dir(wl["policy"], args.rank))) if args.side == "adapter" else None
    llm = LLM(**kw)
    params = [SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=i, logprobs=0)
              for i in range(args.prompts)]
    inputs = [TokensPrompt(prompt_token_ids=p) for p in wl["prompt_ids"][:args.prompts]]

    def call() -> int:
        outs = llm.generate(inputs, params, use_tqdm=False, lora_request=request)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    call()
    seconds, tokens = [], 0
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        tokens = call()
        seconds.append(time.perf_counter() - t0)
    out = {"side": args.side, "tokens": tokens, "seconds": sorted(seconds)[len(seconds) // 2]}
    if args.profile and args.side == "adapter":
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            call()
        out["profile"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.side:
        print("RESULT " + json.dumps(child(args)))
        return 0
    flags = [f"--prompts={args.prompts}", f"--new-tokens={args.new_tokens}", f"--rank={args.rank}",
             f"--dtype={args.dtype}", f"--repeats={args.repeats}"] + (["--profile"] if args.profile else [])
    results = {}
    for side in SIDES:
        done = subprocess.run([sys.executable, "-m", "bench.lora_generation", f"--side={side}", *flags],
                              capture_output=True, text=True)
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"bench.lora_generation: the {side} side failed:\n{done.stderr[-3000:]}", file=sys.stderr)
            return 1
        results[side] = json.loads(line.removeprefix("RESULT "))
    print(f"{args.prompts} prompts x {args.new_tokens} tokens, {args.dtype}, adapter rank {args.rank}")
    print(f"{'side':10s} {'tokens/s':>9s} {'vs plain':>9s}")
    plain = results["plain"]["tokens"] / results["plain"]["seconds"]
    for side, r in results.items():
        rate = r["tokens"] / r["seconds"]
        print(f"{side:10s} {rate:9.0f} {rate / plain:8.2f}x")
    if "profile" in results["adapter"]:
        print(results["adapter"]["profile"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

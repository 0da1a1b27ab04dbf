"""Component benchmark: vLLM generator, weight sync and the DeepSpeed learner, on CPU.

    .venv/bin/python -m bench.components --model tiny --ranks 1 2
    .venv/bin/python -m bench.components --model 30m --ranks 1

Prints one line per figure. The ~30M model is randomly initialised (it measures speed,
not learning); the tiny one is the pre-trained default. Run on a quiet machine.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import ray
import torch

from actors.generator import actor_class
from actors.reference import Reference
from bench.procmem import tree_peak_rss_bytes
from cluster.demo.pretrain import build_pretrained_policy
from cluster.demo.tiny_models import SPEC_30M, build_policy


def model_path(name: str) -> str:
    return str(build_pretrained_policy()) if name == "tiny" else str(build_policy(SPEC_30M))


def bench_generator(path: str, prompts: list, new_tokens: int):
    t0 = time.perf_counter()
    gen = actor_class().options(name="bench-generator", num_cpus=1).remote(
        model=path, sampling={"max_new_tokens": new_tokens, "n": 4},
        engine={"max_model_len": 256, "kv_cache_bytes": 256 << 20})
    ray.get(gen.health.remote())
    print(f"generator: engine start {time.perf_counter() - t0:.1f}s")
    ray.get(gen.generate.remote(prompts[:4]))  # warm-up
    result = ray.get(gen.generate.remote(prompts)).summary
    print(f"generator: {result.generated_tokens} tokens in {result.seconds:.2f}s = "
          f"{result.tokens_per_second:.0f} tokens/s ({len(prompts)} prompts x 4 samples)")
    ref = Reference(model=path)
    rollouts = result.rollouts[:32]
    hf = ref.logprobs([r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts])
    gap = max(float(np.abs(h - r.behaviour_logprobs).max()) for h, r in zip(hf, rollouts))
    print(f"generator: vLLM vs HF logprob max abs diff {gap:.2e} (32 rollouts, fp32)")
    pid = ray.get(gen.health.remote())["pid"]
    print(f"generator: peak RSS {tree_peak_rss_bytes(pid) / 2**20:.0f} MiB (actor + vLLM engine processes)")
    return gen, result.rollouts


def scored(rollouts):
    """Turn generated rollouts into ScoredRollouts with a random score (speed only)."""
    from core.annotate import annotate
    rng = np.random.default_rng(0)
    refs = [r.behaviour_logprobs + rng.normal(0, 0.05, len(r.response_ids)).astype(np.float32)
            for r in rollouts]
    return annotate(rollouts, refs, rng.normal(size=len(rollouts)).astype(np.float32), beta=0.05)


def bench_learner(path: str, rollouts, ranks: int, gen, zero: int):
    from core.rollout import shard_rollouts
    from learner.config import LearnerConfig
    from learner.group import LearnerGroup

    n = len(rollouts) - len(rollouts) % (ranks * 8)
    cfg = LearnerConfig.from_dict({"zero_stage": zero, "optim": {"lr": 1e-5},
                                   "ppo": {"ppo_epochs": 1, "minibatch_size": n,
                                           "micro_batch_size": 8}})
    t0 = time.perf_counter()
    group = LearnerGroup(model=path, config=cfg, world_size=ranks,
                         name_prefix=f"bench-learner-{ranks}")
    print(f"learner: {ranks} rank(s) started in {time.perf_counter() - t0:.1f}s")
    try:
        shards = shard_rollouts(rollouts[:n], ranks)
        group.train(shards)  # warm-up (first step builds optimizer state)
        times, tps = [], []
        for _ in range(3):
            m = group.train(shards)
            times.append(m["perf/learner_seconds"])
            tps.append(m["perf/learner_tokens_per_s"])
        tokens = sum(len(r.response_ids) for r in rollouts[:n])
        print(f"learner: {ranks} rank(s) ZeRO-{zero}: {np.median(times):.2f}s per PPO update "
              f"({n} rollouts, {tokens} response tokens), {np.median(tps):.0f} tokens/s")
        sync = group.push_weights({"bench-generator": gen}, version=1 + ranks)
        print(f"weight sync: {sync['bytes'] / 1e6:.1f} MB in {sync['buckets']} bucket(s), "
              f"{sync['seconds']:.2f}s")
        peaks = ", ".join(f"{tree_peak_rss_bytes(pid) / 2**20:.0f}" for pid in group.pids())
        print(f"learner: peak RSS per rank {peaks} MiB")
    finally:
        group.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["tiny", "30m"], default="tiny")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1])
    ap.add_argument("--zero", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    path = model_path(args.model)
    n_params = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM
                   .from_pretrained(path).parameters())
    print(f"model: {args.model} ({n_params / 1e6:.1f}M parameters) at {path}")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    from cluster.demo.sentiment import builtin_prompts
    prompts = [np.asarray(tok(p)["input_ids"]) for p in builtin_prompts()[:args.prompts]]
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR")
    torch.set_num_threads(1)
    gen, rollouts = bench_generator(path, prompts, args.new_tokens)
    batch = scored(rollouts)
    for ranks in args.ranks:
        bench_learner(path, batch, ranks, gen, args.zero)
    ray.shutdown()


if __name__ == "__main__":
    main()

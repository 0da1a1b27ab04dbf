"""The prefix cache with and without session affinity: sessions through the gateway over two
generator replicas, each session a long context of its own and then several calls, each call's
prompt the previous one's plus its completion plus a few words (as an agent's history grows).

    .venv/bin/python -m bench.gateway_affinity                 # 16 sessions x 4 calls, ~300-token contexts
    .venv/bin/python -m bench.gateway_affinity --sessions 4 --calls 2 --context 150   # smoke

Two sides, in one run, on the same sessions (the same seeds, the same texts):
  - affinity: the gateway as a run starts it: a session's calls go to one replica while it
    lives, so that replica's prefix cache holds the session's history;
  - spread: each call goes to the next replica in turn (``SpreadGateway.route``), as a router
    without affinity would send it.
Each side gets fresh replicas (empty caches). Prints the share of the calls' prompt tokens the
replicas' prefix caches held (vLLM's ``num_cached_tokens``, what gateway/prefix_cache_hit_rate
reports), calls/s and seconds per call. vLLM caches whole blocks only: a context shorter than
one block is never held. Writes runs/bench/gateway_affinity.json.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from actors.gateway.server import Gateway

REPO = Path(__file__).resolve().parents[1]


class SpreadGateway(Gateway):
    """The gateway without affinity: each call to the next live replica in turn."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._turns = itertools.count()

    def route(self, session) -> str:
        names = sorted(self.generators)
        return names[next(self._turns) % len(names)]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.gateway_affinity", description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--calls", type=int, default=4, help="calls per session")
    ap.add_argument("--context", type=int, default=300, help="words of each session's own context")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=8, help="sessions played at once")
    ap.add_argument("--out", default="runs/bench/gateway_affinity.json")
    return ap.parse_args(argv)


def contexts(n: int, words: int) -> list[str]:
    """A context of its own per session, from the built-in corpus's sentences."""
    from cluster.demo.sentiment import corpus

    lines = corpus()
    out = []
    for i in range(n):
        rng = random.Random(i)
        text = []
        while sum(len(t.split()) for t in text) < words:
            text.append(rng.choice(lines))
        out.append(" ".join(text))
    return out


def play_session(url: str, context: str, calls: int, new_tokens: int) -> None:
    """One session: the context, then ``calls`` completions, each prompt extending the last."""
    import httpx
    import openai

    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300,
                           http_client=httpx.Client(trust_env=False))
    prompt = context
    for k in range(calls):
        reply = client.completions.create(model="policy", prompt=prompt, max_tokens=new_tokens)
        prompt = prompt + reply.choices[0].text + f" Then, part {k + 2}:"


def run_side(name: str, gateway_class, args, policy: str, texts: list[str]) -> dict:
    import ray

    from actors.generator import actor_class, engine_process_env
    from cluster.runtime.pools.threads import thread_env

    env = {**thread_env(1, vllm=True), **engine_process_env(num_gpus=0, tensor_parallel=1)}
    sampling = {"temperature": 1.0, "max_new_tokens": args.new_tokens, "seed": 0}
    engine = {"max_model_len": 512, "kv_cache_bytes": 64 << 20}
    gens = {f"{name}-generator-{i}": actor_class().options(name=f"{name}-generator-{i}", num_cpus=1,
                                                          runtime_env={"env_vars": env}).remote(
        model=policy, sampling=sampling, engine=engine) for i in range(2)}
    gw = ray.remote(num_cpus=0)(gateway_class).options(
        name=f"{name}-gateway", runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}}).remote(
        generators=gens, tokenizer=policy, model_name="policy", sampling=sampling, max_model_len=512)
    try:
        ray.get([g.health.remote() for g in gens.values()])
        ray.get(gw.start.remote())
        urls = [ray.get(gw.open_session.remote(f"s{i}", prompt_index=i, sample_index=0)) for i in range(len(texts))]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(lambda ut: play_session(*ut, args.calls, args.new_tokens), zip(urls, texts)))
        seconds = time.perf_counter() - t0
        sessions = [ray.get(gw.close_session.remote(f"s{i}")) for i in range(len(texts))]
    finally:
        for actor in [gw, *gens.values()]:
            ray.kill(actor)
    prompt = sum(s.counts["prompt_tokens"] for s in sessions)
    cached = sum(s.counts["cached_tokens"] for s in sessions)
    calls = sum(s.counts["calls"] for s in sessions)
    return {"side": name, "calls": calls, "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": cached / max(prompt, 1), "seconds": seconds, "calls_per_s": calls / seconds}


def main(argv=None) -> int:
    args = parse_args(argv)
    import ray

    from cluster.runtime.state.models import resolve_model

    policy = resolve_model("builtin:tiny")
    texts = contexts(args.sessions, args.context)
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    try:
        rows = [run_side(name, cls, args, policy, texts)
                for name, cls in (("affinity", Gateway), ("spread", SpreadGateway))]
    finally:
        ray.shutdown()
    print(f"gateway affinity bench: {args.sessions} sessions x {args.calls} calls, ~{args.context}-word contexts, "
          f"2 replicas")
    for r in rows:
        print(f"  {r['side']:9s} prefix-cache hit rate {r['hit_rate']:.3f} ({r['cached_tokens']} of "
              f"{r['prompt_tokens']} prompt tokens)  {r['calls_per_s']:.1f} calls/s  "
              f"{1000 * r['seconds'] / r['calls']:.0f} ms a call")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "sides": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

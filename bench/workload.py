"""The tether-vs-TRL benchmark workload (bench.vs_trl), built offline, seeded and cached: models and prompts.

    .venv/bin/python -m bench.workload          # build it, print workload.json's path

One folder holds everything both sides of bench.vs_trl read: the ~31.7M-parameter Qwen2
policy (also the frozen reference), a Qwen2 sequence classifier of the same shape as the
reward model (its copy is TRL's value model and tether's separate critic), and prompts
that are exactly `prompt_tokens` tokens long and survive a decode/encode round trip, so
tether (which tokenizes text) and TRL (which takes token ids) feed the same ids. The TRL
side runs in another virtualenv, so workload.json is plain data and this file is the
only one that knows how it was made.

``ragged=True``: the same, with the policy (and reference) replaced by bench/stopping_policy.py's,
which ends its responses at EOS at spread lengths; workload.json then says ``"ragged": true``.
"""
from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path

from cluster.demo.sentiment import corpus
from cluster.demo.tiny_models import SPEC_BENCH_32M, build_policy, build_reward_model, cache_root, cached_build

FORMAT = 1  # bump when the recipe changes


def _prompts(tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    """n distinct prompts of exactly `length` token ids that decode and re-encode unchanged."""
    sentences = corpus(n_sentences=max(4 * n, 2000), seed=seed)
    random.Random(seed).shuffle(sentences)
    out, seen = [], set()
    for text in (f"{a} {b}" for a, b in zip(sentences[::2], sentences[1::2])):  # two: long enough to cut
        ids = tokenizer(text, add_special_tokens=True)["input_ids"][:length]
        if len(ids) < length or tuple(ids) in seen:
            continue
        if tokenizer(tokenizer.decode(ids), add_special_tokens=True)["input_ids"] != ids:
            continue  # a cut inside a merge re-tokenizes differently: not the same prompt on both sides
        seen.add(tuple(ids))
        out.append(ids)
        if len(out) == n:
            return out
    raise ValueError(f"the built-in corpus has only {len(out)} usable {length}-token prompts (asked for {n}); "
                     "lower --prompt-tokens")


def build_workload(*, prompts: int = 256, prompt_tokens: int = 16, seed: int = 0, ragged: bool = False) -> Path:
    """The workload folder (built once per setting, then reused); returns workload.json's path."""
    from bench.stopping_policy import FEATURE, HAZARD, NORM_GAIN

    policy, reward = build_policy(SPEC_BENCH_32M), build_reward_model(SPEC_BENCH_32M)
    setting = [FORMAT, SPEC_BENCH_32M.key("policy"), prompts, prompt_tokens, seed]
    setting += ["stops", HAZARD, FEATURE, NORM_GAIN] if ragged else []  # the fixed workload keeps its folder
    key = hashlib.sha256(json.dumps(setting).encode()).hexdigest()[:16]

    def build(out: Path) -> None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(policy)
        ids = _prompts(tok, prompts, prompt_tokens, seed)
        with open(out / "prompts.jsonl", "w") as f:
            for row in ids:
                f.write(json.dumps({"prompt": tok.decode(row)}) + "\n")
        final = cache_root() / f"bench-workload-{key}"
        sampled = policy
        if ragged:
            from bench.stopping_policy import build_stopping_policy
            (out / "policy").mkdir()
            build_stopping_policy(policy, out / "policy", ids, eos=tok.eos_token_id, pad=tok.pad_token_id, seed=seed)
            sampled = final / "policy"
        (out / "workload.json").write_text(json.dumps({
            "policy": str(sampled), "reference": str(sampled), "reward": str(reward), "value": str(reward),
            "tokenizer": str(policy), "prompts_path": str(final / "prompts.jsonl"), "prompt_ids": ids,
            "prompt_tokens": prompt_tokens, "seed": seed, "vocab_size": SPEC_BENCH_32M.vocab_size,
            "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, "ragged": ragged}, indent=None))

    final = cache_root() / f"bench-workload-{key}"
    if not (final / "workload.json").exists():  # cached_build keys on config.json, which this folder lacks
        cached_build(final, build)
    return final / "workload.json"


def parameter_count(path: str) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())


if __name__ == "__main__":
    wl = build_workload()
    data = json.loads(wl.read_text())
    print(wl)
    print(f"policy {data['policy']}: {parameter_count(data['policy']) / 1e6:.2f}M parameters", file=sys.stderr)

"""The ragged workload's policy: the bench policy, set to end its responses at EOS at spread lengths.

A random-weight policy samples EOS about as often as any other of its 512 tokens, so almost
every response runs to the token budget and nothing is ragged. This one has a constant feature
that raises EOS's logit by the same amount at every position, so a response stops with
roughly the same probability (``HAZARD``) after each token: lengths spread from 1 to the budget
(geometric, mean about 1 / HAZARD), the same distribution for every sampler of these weights
(vLLM in tether, HF ``generate`` in TRL). Sampled on the workload's 64 prompts with a budget of
128 tokens: mean 56, median 42, 9 of 64 rows cut at the budget.

How: hidden dimension ``d`` (the last) carries the constant ``FEATURE`` in every token's
embedding, and no layer writes to it (the rows ``d`` of every attention and MLP output
projection are zeroed), so the final residual's ``d`` is that constant at every position, about
1 after the final norm. The constant is large (25x the embeddings' scale) so that what the PPO
steps of a benchmark write into those rows leaves the policy whole: with 0.02 and a norm
weight of 25 instead, a first update made the second step's policy another one (approx KL 30).
The updates still move the rate: tether's policy averaged 51 tokens before its first update
and 60-65 after (bench.vs_trl reports each side's response tokens a step for that reason).
The embeddings are tied, so the logit of
token v gets (that feature) x E[v, d]: the same for every token but EOS, whose E[eos, d] is
set (by bisection) to give ``HAZARD`` on average, and the pad token, pushed out of reach (TRL
ends a response at its first pad token). Everything else is the random policy: the same
shapes, so the same work per token.
"""
from __future__ import annotations

from pathlib import Path

HAZARD = 1 / 64        # the mean probability of EOS after each response token
FEATURE = 0.5          # the constant feature in every embedding: large against what training writes into it
NORM_GAIN = 1.0        # the final norm's weight on it (FEATURE / rms(residual) is about 1 already)
PAD_OFFSET = -30.0     # the pad token's logit offset: never sampled


def add_stop_feature(model, *, eos: int, pad: int, hazard: float, probe_ids) -> float:
    """Give ``model`` (a Qwen2ForCausalLM with tied embeddings, in place) a mean EOS probability
    of ``hazard`` per position over ``probe_ids`` [B, T] (prompts then random tokens); -> the
    measured mean at the EOS offset found."""
    import torch

    d = model.config.hidden_size - 1
    emb = model.model.embed_tokens.weight
    with torch.no_grad():
        emb[:, d] = FEATURE
        emb[pad, d] = FEATURE + PAD_OFFSET
        for layer in model.model.layers:  # nothing writes to dimension d: it stays FEATURE throughout
            layer.self_attn.o_proj.weight[d] = 0.0
            layer.mlp.down_proj.weight[d] = 0.0
        model.model.norm.weight[d] = NORM_GAIN
        hidden = model.model(input_ids=probe_ids).last_hidden_state  # after the final norm: [B, T, H]
        lo, hi = 0.0, 20.0
        for _ in range(40):  # the mean EOS probability grows with the offset: bisect
            emb[eos, d] = FEATURE + (lo + hi) / 2
            mean = float(torch.softmax(hidden @ emb.T, -1)[..., eos].mean())
            lo, hi = ((lo + hi) / 2, hi) if mean < hazard else (lo, (lo + hi) / 2)
    return mean


def build_stopping_policy(policy: Path, out: Path, prompt_ids: list[list[int]], *, eos: int, pad: int,
                          hazard: float = HAZARD, seed: int = 0) -> float:
    """Write the stopping policy made from ``policy`` (an HF folder) into ``out`` with the policy's
    tokenizer files; -> the mean EOS probability it was set to over the probe sequences (the
    prompts, then as many random non-special tokens)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    prompts = torch.tensor(prompt_ids[:64])
    rng = torch.Generator().manual_seed(seed)
    tail = torch.randint(max(eos, pad) + 1, model.config.vocab_size, (len(prompts), 128), generator=rng)
    mean = add_stop_feature(model, eos=eos, pad=pad, hazard=hazard, probe_ids=torch.cat([prompts, tail], 1))
    model.save_pretrained(out, safe_serialization=True)
    for f in Path(policy).iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy2(f, out / f.name)
    return mean

"""Tiny models of the transformer families tether is checked with, built offline.

Each family is a causal LM and a sequence-classification reward model (``num_labels=1``) of
the same architecture, with tether's tiny tokenizer beside them, randomly initialised and
cached like the tiny Qwen2 models (cluster/demo/tiny_models.py). Every tensor is jittered
after init, so norms and biases (ones and zeros at init) differ from their defaults: a
norm that lands in the wrong place after a weight push changes the log-probs.

The family names are those of the family table in docs/guide/models.md and of tests/families/:

    python -m cluster.demo.families              # build every family, print the paths
    python -m cluster.demo.families gemma2 llama # some of them
"""
from __future__ import annotations

import sys
from pathlib import Path

from cluster.demo.tiny_models import TinySpec, build_tokenizer, cache_root, cached_build

# Two layers with a window of 8 tokens: prompts are longer, so sliding attention is exercised.
FAMILY_SPEC = TinySpec(intermediate_size=256, num_hidden_layers=2, tie_word_embeddings=False, seed=0)
SLIDING_WINDOW = 8
JITTER = 0.02
BUILD_VERSION = 2  # bump when a family's recipe changes, so old caches are not reused


def _ids(s: TinySpec, tok) -> dict:
    # The model's vocabulary is larger than the tokenizer's, as with the tiny Qwen2 (and many real models).
    return dict(vocab_size=s.vocab_size, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                bos_token_id=tok.eos_token_id)


def _llama_like(s: TinySpec, tok) -> dict:
    return dict(hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                num_hidden_layers=s.num_hidden_layers, num_attention_heads=s.num_attention_heads,
                num_key_value_heads=s.num_key_value_heads, max_position_embeddings=s.max_position_embeddings,
                **_ids(s, tok))


def _head_dim(s: TinySpec) -> int:
    return s.hidden_size // s.num_attention_heads


def _config(family: str, s: TinySpec, tok):
    """The HF config of ``family`` at the sizes of ``s``."""
    import transformers as T

    base = _llama_like(s, tok)
    if family == "llama":
        return T.LlamaConfig(**base, tie_word_embeddings=False)
    if family in ("qwen2-tied", "qwen2-untied"):
        return T.Qwen2Config(**base, tie_word_embeddings=family == "qwen2-tied")
    if family == "mistral":
        return T.MistralConfig(**base, sliding_window=SLIDING_WINDOW, tie_word_embeddings=False)
    if family == "gemma2":  # soft-capping small enough to bite on tiny logits
        return T.Gemma2Config(**base, head_dim=_head_dim(s), sliding_window=SLIDING_WINDOW,
                              attn_logit_softcapping=2.0, final_logit_softcapping=2.0, tie_word_embeddings=True)
    if family == "gemma3":
        return T.Gemma3TextConfig(**base, head_dim=_head_dim(s), sliding_window=SLIDING_WINDOW,
                                  layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True)
    if family == "phi3":
        return T.Phi3Config(**base, tie_word_embeddings=False)
    if family == "gpt-neox":
        return T.GPTNeoXConfig(hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                               num_hidden_layers=s.num_hidden_layers, num_attention_heads=s.num_attention_heads,
                               max_position_embeddings=s.max_position_embeddings, rotary_pct=0.25,
                               tie_word_embeddings=False, **_ids(s, tok))
    if family == "gpt2":
        return T.GPT2Config(n_embd=s.hidden_size, n_inner=s.intermediate_size, n_layer=s.num_hidden_layers,
                            n_head=s.num_attention_heads, n_positions=s.max_position_embeddings, **_ids(s, tok))
    if family == "gpt-neo":
        return T.GPTNeoConfig(hidden_size=s.hidden_size, num_layers=s.num_hidden_layers,
                              num_heads=s.num_attention_heads, attention_types=[[["global", "local"], 1]],
                              window_size=SLIDING_WINDOW, max_position_embeddings=s.max_position_embeddings,
                              **_ids(s, tok))
    if family == "bert":
        return T.BertConfig(hidden_size=s.hidden_size, num_hidden_layers=s.num_hidden_layers,
                            num_attention_heads=s.num_attention_heads, intermediate_size=s.intermediate_size,
                            max_position_embeddings=s.max_position_embeddings, vocab_size=s.vocab_size,
                            pad_token_id=tok.pad_token_id)
    raise ValueError(f"unknown model family {family!r}; use one of {', '.join(FAMILIES)}")


# HF architecture of each family's causal LM (what config.json names).
FAMILIES = {"llama": "LlamaForCausalLM", "qwen2-tied": "Qwen2ForCausalLM", "qwen2-untied": "Qwen2ForCausalLM",
            "mistral": "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
            "phi3": "Phi3ForCausalLM", "gpt-neox": "GPTNeoXForCausalLM", "gpt2": "GPT2LMHeadModel"}
# Families tether refuses at start-up (core/modeling/architectures.py), kept to test the refusal:
# GPT-Neo is a causal LM in transformers that vLLM does not serve; BERT is no causal LM.
REFUSED = {"gpt-neo": "GPTNeoForCausalLM", "bert": "BertForMaskedLM"}


def _build(family: str, kind: str, spec: TinySpec) -> Path:
    def build(out: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(build_tokenizer(spec.vocab_size))
        config = _config(family, spec, tok)
        config.dtype = "float32"
        torch.manual_seed(spec.seed)
        if family == "bert":
            from transformers import BertForMaskedLM
            model = BertForMaskedLM(config)
        elif kind == "policy":
            model = AutoModelForCausalLM.from_config(config)
        else:
            config.num_labels = 1
            model = AutoModelForSequenceClassification.from_config(config)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(JITTER * torch.randn_like(p))
        model.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)

    if family not in FAMILIES and family not in REFUSED:
        raise ValueError(f"unknown model family {family!r}; use one of {', '.join(FAMILIES)}")
    return cached_build(cache_root() / f"{family}-{kind}-{spec.key(f'{family}-{kind}-v{BUILD_VERSION}')}", build)


def build_family_policy(family: str, spec: TinySpec = FAMILY_SPEC) -> Path:
    """A tiny causal LM of ``family`` (a key of FAMILIES), with the tiny tokenizer beside it."""
    return _build(family, "policy", spec)


def build_family_reward(family: str, spec: TinySpec = FAMILY_SPEC) -> Path:
    """A tiny sequence-classification model (num_labels=1) of ``family``: a reward model."""
    return _build(family, "reward", spec)


if __name__ == "__main__":
    for name in sys.argv[1:] or FAMILIES:
        print(f"{name}: policy {build_family_policy(name)}, reward {build_family_reward(name)}")

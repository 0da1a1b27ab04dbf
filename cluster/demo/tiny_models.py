"""Tiny models built offline: tokenizer, Qwen2 causal LM, Qwen2 reward model.

Nothing here touches the network. Each artefact is saved in Hugging Face format
and cached on disk under a key derived from everything that shapes it (sizes,
seed, corpus, this file's format version), so tests and the demo build it once
and every loader in the project takes it like a real checkpoint.

    python -m cluster.demo.tiny_models            # build the defaults, print their paths
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from cluster.demo.sentiment import corpus
from core.infra.files import held_lock, publish_dir

FORMAT_VERSION = 1  # bump when the build recipe changes, so old caches are not reused
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"



@dataclass(frozen=True)
class TinySpec:
    """Sizes of a tiny Qwen2-family model. The defaults give ~1M parameters."""
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = True
    seed: int = 0

    def key(self, kind: str) -> str:
        blob = json.dumps({"kind": kind, "v": FORMAT_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ~30M parameters, for benchmarks that need a model big enough to show costs.
SPEC_30M = TinySpec(hidden_size=512, intermediate_size=1408, num_hidden_layers=10,
                    num_attention_heads=8, num_key_value_heads=4)
# ~31.7M parameters: the benchmark workload shared with TRL (bench/workload.py).
SPEC_BENCH_32M = TinySpec(vocab_size=512, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                          num_attention_heads=8, num_key_value_heads=4)


def cache_root() -> Path:
    return Path(os.environ.get("TETHER_CACHE", Path.home() / ".cache" / "tether"))


def cached_build(path: Path, build) -> Path:
    """Build into a temp dir beside `path`, then rename: readers never see half a model. A build
    of `path` under way in another process (the test suite's prebuilder, a second run) is waited
    for, not done twice."""
    if _built(path):
        return path
    with held_lock(path.parent / f".{path.name}.lock"):
        if not _built(path):
            for left in path.parent.glob(f".{path.name}-*"):  # a killed builder's: none runs but us
                shutil.rmtree(left, ignore_errors=True)
            with publish_dir(path, shared=True) as tmp:
                build(tmp)
    return path


def _built(path: Path) -> bool:
    return (path / "config.json").exists() or (path / "tokenizer.json").exists()


def run_apart(module: str, *args: str, what: str) -> None:
    """``python -m module --build args...`` in a fresh interpreter on one thread: a trained tiny
    model's bits must depend on nothing the calling process did before. (vLLM's CPU worker
    replaces ``torch.set_num_threads`` with a no-op once it has bound its threads, so a build
    after an in-process engine ran on every core instead of one: other rounding, another model;
    the arithmetic task's policy then answered 15% of its prompts right instead of 29%.)"""
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", module, "--build", *args], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"building {what} failed (exit {proc.returncode}): {tail}")


def build_tokenizer(vocab_size: int = 1024) -> Path:
    """Byte-level BPE trained on the built-in corpus, with eos and pad tokens."""
    key = hashlib.sha256(f"tok-{vocab_size}-{FORMAT_VERSION}".encode()).hexdigest()[:16]

    def build(out: Path) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=[EOS_TOKEN, PAD_TOKEN],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator(corpus(), trainer=trainer)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN,
                                       pad_token=PAD_TOKEN, model_max_length=512)
        fast.save_pretrained(out)

    return cached_build(cache_root() / f"tokenizer-{key}", build)


def _qwen2_config(spec: TinySpec, tokenizer, **extra):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings, torch_dtype="float32",
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id, **extra)


def _build_model(spec: TinySpec, kind: str) -> Path:
    def build(out: Path) -> None:
        import torch
        from transformers import AutoTokenizer, Qwen2ForCausalLM, Qwen2ForSequenceClassification

        tokenizer = AutoTokenizer.from_pretrained(build_tokenizer(spec.vocab_size))
        torch.manual_seed(spec.seed)
        if kind == "policy":
            model = Qwen2ForCausalLM(_qwen2_config(spec, tokenizer))
        else:
            model = Qwen2ForSequenceClassification(_qwen2_config(spec, tokenizer, num_labels=1))
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)

    return cached_build(cache_root() / f"{kind}-{spec.key(kind)}", build)


def build_policy(spec: TinySpec = TinySpec()) -> Path:
    """A randomly initialised Qwen2ForCausalLM with the tiny tokenizer beside it."""
    return _build_model(spec, "policy")


def build_reward_model(spec: TinySpec = TinySpec()) -> Path:
    """A randomly initialised Qwen2ForSequenceClassification (num_labels=1)."""
    return _build_model(spec, "reward")


if __name__ == "__main__":
    print("tokenizer:", build_tokenizer())
    print("policy:   ", build_policy())
    print("reward:   ", build_reward_model())

"""The models a run names, as directories: builtin:* names built (offline, cached), a LoRA
adapter merged into its base, and the teacher checked against the policy's vocabulary."""
from __future__ import annotations

from pathlib import Path

from cluster.job.errors import UserError
from core.infra.errors import user_input


def resolve_model(name: str, key: str = "model.policy") -> str:
    """builtin:* names build the offline tiny models (cached); anything else is a path."""
    from cluster.config.ppo import BUILTIN_POLICY, BUILTIN_POLICY_30M, BUILTIN_POLICY_POSITIVE

    if name == BUILTIN_POLICY:
        from cluster.demo.pretrain import build_pretrained_policy
        return str(build_pretrained_policy())
    if name == BUILTIN_POLICY_30M:  # randomly initialised: for throughput, not for learning
        from cluster.demo.tiny_models import SPEC_30M, build_policy
        return str(build_policy(SPEC_30M))
    if name == BUILTIN_POLICY_POSITIVE:  # pre-trained on the corpus's positive sentences only: a teacher
        from cluster.demo.pretrain import build_pretrained_policy
        from cluster.demo.sentiment import POSITIVE_WORDS, corpus
        return str(build_pretrained_policy(texts=corpus(words=POSITIVE_WORDS)))
    from cluster.demo import arithmetic
    if name == arithmetic.BUILTIN:  # pre-trained on the arithmetic task's corpus
        return str(arithmetic.build_arithmetic_policy())
    if name.startswith("builtin:"):
        raise UserError(f"{key}={name!r} is not a built-in model; use {BUILTIN_POLICY}, {BUILTIN_POLICY_POSITIVE}, "
                        f"{BUILTIN_POLICY_30M}, {arithmetic.BUILTIN} or a model directory")
    if not Path(name).exists():
        raise UserError(f"{key}={name!r} does not exist; point it at a Hugging Face model directory")
    from learner.lora import is_adapter_dir
    if is_adapter_dir(name):  # a LoRA adapter (an SFT stage's adapter/): its base with it merged in
        return merged_adapter(name)
    return name


def merged_adapter(adapter_dir: str) -> str:
    """The base model of a PEFT adapter with the adapter merged (built once, cached by content)."""
    import hashlib

    from cluster.demo.tiny_models import cache_root, cached_build
    from learner.lora import merge_adapter_dir

    digest = hashlib.sha256(b"".join(f.read_bytes() for f in sorted(Path(adapter_dir).iterdir()) if f.is_file()))
    with user_input():
        return str(cached_build(cache_root() / f"merged-{digest.hexdigest()[:16]}",
                                lambda out: merge_adapter_dir(adapter_dir, out)))


def prepare_teacher(cfg, tokenizer, tokenizer_path: str, policy: str):
    """teacher.model as the reference replicas load it (a builtin:* name built), checked to share
    the policy's vocabulary and tokenizer; None without a teacher."""
    if not cfg.teacher.enabled:
        return None
    from cluster.runtime.state.lineage import check_frozen_model

    path = resolve_model(cfg.teacher.model, "teacher.model")
    with user_input():
        check_frozen_model(path, tokenizer, tokenizer_path, policy, key="teacher.model", role="the teacher")
    return path

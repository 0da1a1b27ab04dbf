"""Where a checkpoint came from, and the PPO-side checks that use it.

The SFT and reward-model stages write ``tether_stage.json`` beside their checkpoints:

    {"stage": "sft", "base": "/abs/path/of/the/model/it/was/fine-tuned/from", "base_name": "builtin:tiny"}
    {"stage": "reward_model", "base": "/abs/path/of/the/sft/checkpoint", ...}

PPO's KL penalty tethers the policy to the reference; InstructGPT's recipe tethers it to
the SFT model, which is what the run starts from, so the reference defaults to the policy.
``reference.model`` may name another model (same vocabulary); the run then warns, in one
line, when the marker files show an honest mistake: the reference is the very base model
the policy's SFT started from, or the policy is an SFT output and the reference is not.
A model without a marker file (trained elsewhere) is "unknown" and only compared by path.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

log = logging.getLogger("tether")

STAGE_FILE = "tether_stage.json"


def write_stage(out_dir, stage: str, base: str, **extra) -> None:
    """Mark ``out_dir`` as the output of ``stage`` trained from ``base`` (a directory)."""
    info = {"stage": stage, "base": str(Path(base).resolve()), **extra}
    (Path(out_dir) / STAGE_FILE).write_text(json.dumps(info, indent=1) + "\n")


def read_stage(model_dir) -> Optional[dict]:
    """The marker of ``model_dir``, or None (no file, or one that is not a JSON object)."""
    try:
        info = json.loads((Path(model_dir) / STAGE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def same_path(a, b) -> bool:
    return Path(a).resolve() == Path(b).resolve()


def tether_warning(policy: str, reference: str) -> Optional[str]:
    """The one-line warning for a reference that is probably not the SFT model, or None."""
    pol, ref = read_stage(policy), read_stage(reference)
    if pol is None or pol.get("stage") != "sft":
        return None  # nothing known about the policy's history: no basis for a warning
    if pol.get("base") and same_path(pol["base"], reference):
        return (f"reference.model={reference} is the base model the policy's SFT started from "
                f"({Path(policy) / STAGE_FILE}); the KL tether should be the SFT model: leave reference.model "
                "unset to use the policy the run starts from")
    if ref is None or ref.get("stage") != "sft":
        return (f"reference.model={reference} is not an SFT output (no {STAGE_FILE} with stage 'sft') while the "
                f"policy {policy} is; the KL tether should be the SFT model: leave reference.model unset")
    return None


def check_reference(path: str, tokenizer, tokenizer_path: str, policy: str) -> str:
    """``reference.model``: an existing causal-LM directory with the run's vocabulary.
    Returns the path; raises ValueError (one line) otherwise; logs the tether warning."""
    check_frozen_model(path, tokenizer, tokenizer_path, policy, key="reference.model", role="the reference")
    warning = tether_warning(policy, path)
    if warning:
        log.warning("warning: %s", warning)
    return path


def check_frozen_model(path: str, tokenizer, tokenizer_path: str, policy: str, *, key: str, role: str) -> None:
    """A frozen model that scores the policy's sampled ids (``key``: reference.model, teacher.model):
    an existing causal-LM directory with the policy's vocabulary and tokenizer, else a one-line
    ValueError naming ``key``."""
    from transformers import AutoConfig, AutoTokenizer

    p = Path(path)
    if not (p / "config.json").is_file():
        raise ValueError(f"{key}={path!r} is not a Hugging Face model directory (no config.json); "
                         "point it at a causal-LM checkpoint" + (", or leave it unset to use the policy"
                                                                  if key == "reference.model" else ""))
    from core.modeling.architectures import check_policy_config
    config = AutoConfig.from_pretrained(path)
    check_policy_config(config, key)  # a causal LM too
    vocab = getattr(config.get_text_config(), "vocab_size", None)
    policy_vocab = getattr(AutoConfig.from_pretrained(policy).get_text_config(), "vocab_size", None)
    if vocab != policy_vocab or (vocab and len(tokenizer) > vocab):
        raise ValueError(f"{key}={path!r} has vocab_size={vocab} but the policy has {policy_vocab} "
                         f"(tokenizer {tokenizer_path}: {len(tokenizer)} tokens); {role} must share the "
                         "policy's tokenizer and vocabulary")
    if any((p / f).exists() for f in ("tokenizer.json", "vocab.json", "tokenizer.model")):
        own = AutoTokenizer.from_pretrained(path).get_vocab()
        if own != tokenizer.get_vocab():
            raise ValueError(f"{key}={path!r} has another tokenizer than the policy's ({tokenizer_path}); "
                             f"{role} must share the policy's tokenizer and vocabulary")

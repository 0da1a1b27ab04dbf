"""Which Hugging Face architectures tether can train, serve and push weights to, checked
before a model loads, and the one loading rule a family needs.

What is refused, each in one line naming the architecture and the fix (``UnsupportedModel``):

* a policy that transformers' ``AutoModelForCausalLM`` does not load as a text causal LM
  (the learner and the reference run it so), or whose config names no architecture;
* a quantized checkpoint (``quantization_config``): the learner pushes full-precision
  tensors, which a quantized vLLM layer cannot take in place;
* a reward model that ``AutoModelForSequenceClassification`` does not load;
* a policy that vLLM does not serve as a text generator (natively or through its
  Transformers backend), or serves as a multimodal model: checked by the generator, which
  has vLLM loaded (``actors.generator``), and reported by the driver like the others.

Names are mapped by vLLM's own weight loader (``load_weights`` of its model class), never
by tables of ours, so an architecture vLLM serves takes tether's push as its checkpoint.
"""
from __future__ import annotations

from typing import Optional

from core.infra.errors import InputError


class UnsupportedModel(InputError):
    """A model tether cannot train or serve; the driver reports it as a one-line user error,
    whether it was raised there or in an actor's constructor (``unsupported_model``)."""


def architecture(config) -> str:
    names = list(getattr(config, "architectures", None) or [])
    return names[0] if names else ""


def check_policy_config(config, key: str = "model.policy") -> None:
    """Refuse a policy the learner, the reference or the weight push cannot handle."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = architecture(config)
    if not arch:
        raise UnsupportedModel(f"{key}: its config.json names no architecture; tether needs a causal LM "
                               "checkpoint whose config.json lists one (e.g. LlamaForCausalLM)")
    causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", ""))
    if arch != causal or arch.endswith("ForConditionalGeneration"):
        raise UnsupportedModel(f"{key}: architecture {arch} is not a text causal LM that transformers' "
                               "AutoModelForCausalLM loads; tether trains decoder-only causal LMs "
                               "(e.g. LlamaForCausalLM, Qwen2ForCausalLM): use such a checkpoint")
    if getattr(config, "quantization_config", None):
        raise UnsupportedModel(f"{key}: {arch} checkpoint is quantized (quantization_config); weight pushes "
                               "need full-precision weights: use the unquantized checkpoint")


def check_reward_config(config, key: str = "reward.model") -> None:
    """Refuse a reward model that AutoModelForSequenceClassification cannot load."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    model_type = getattr(config, "model_type", "")
    if model_type not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
        raise UnsupportedModel(f"{key}: model type {model_type or '?'} ({architecture(config) or 'no architecture'}) "
                               "has no sequence-classification class in transformers; use a reward model "
                               "of a family that has one (e.g. LlamaForSequenceClassification)")


def attention_kwargs(config) -> dict:
    """Extra ``from_pretrained`` arguments so that transformers computes what vLLM computes.

    Attention logit soft-capping (Gemma-2) is skipped by transformers' sdpa kernel and
    applied by vLLM, so the learner's log-probs would differ from the sampler's (measured on
    a tiny Gemma-2 with caps of 2: gap 0.8 nats with sdpa, 1e-6 with eager attention).
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return {"attn_implementation": "eager"} if getattr(text, "attn_logit_softcapping", None) else {}


def unsupported_model(error: Optional[BaseException]) -> Optional[str]:
    """The message of an ``UnsupportedModel`` behind ``error``, else None. Raised in an actor's
    constructor, it reaches the driver inside Ray's ActorDiedError, whose text alone carries it."""
    marker = f"{UnsupportedModel.__name__}: "
    for _ in range(8):  # error, its cause, ...: a few wrappers at most
        if error is None:
            return None
        if type(error) is UnsupportedModel:
            return str(error)
        for line in str(error).splitlines():
            if marker in line:
                return line.split(marker, 1)[1].strip()
        error = error.__cause__ or error.__context__
    return None


def load_pretrained(auto_class, path, **kwargs):
    """``auto_class.from_pretrained(path, **kwargs)`` with the family's ``attention_kwargs``:
    every HF forward in tether (learner, reference, reward, critic) loads through here."""
    from transformers import AutoConfig

    return auto_class.from_pretrained(path, **attention_kwargs(AutoConfig.from_pretrained(path)), **kwargs)

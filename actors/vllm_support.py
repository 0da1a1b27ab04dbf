"""Whether this vLLM serves a policy checkpoint as a text generator, asked before the engine starts.

vLLM decides which of its model classes (or its Transformers backend) serves a checkpoint when
it builds its ``ModelConfig``; building that alone costs a few milliseconds once vLLM is
imported, and its verdict becomes a one-line ``UnsupportedModel`` instead of a failed engine.
"""
from __future__ import annotations

from core.architectures import UnsupportedModel


def check_served(model: str, key: str = "model.policy") -> None:
    """UnsupportedModel unless vLLM serves ``model`` as a text-only generator."""
    import vllm
    from vllm.config import ModelConfig

    try:
        config = ModelConfig(model=model, runner="generate")
    except Exception as e:  # noqa: BLE001 - vLLM raises pydantic's ValidationError, whose text says why
        text = str(e)
        if "are not supported" not in text and "do not support `--runner generate`" not in text:
            raise
        from transformers import AutoConfig
        arch = (AutoConfig.from_pretrained(model).architectures or ["?"])[0]
        raise UnsupportedModel(f"{key}: vLLM {vllm.__version__} does not serve architecture {arch} as a text "
                               "generator; use a model family vLLM supports (README: Model families)") from None
    if config.is_multimodal_model:
        raise UnsupportedModel(f"{key}: vLLM serves {config.architecture} as a multimodal model; tether trains "
                               "text-only causal LMs: use the text-only checkpoint of this family")

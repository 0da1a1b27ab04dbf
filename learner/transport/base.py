"""Moving weights learner -> generators.

Three transports behind one ``push(version, named, *, tied_embeddings) -> report``, picked by
``learner.export.make_weight_sync``: "cpu" (here), and on GPU "nccl" (learner/transport/nccl.py) and
"ipc" (learner/transport/ipc.py), both on vLLM's weight-transfer API (learner/transport/vllm_api.py).

CPU transport: learner rank 0 holds the full state (gathered under ZeRO-3), cuts it
into size-bounded buckets of safetensors bytes once, and every generator reloads
them in place through vLLM's worker extension. Bytes, not tensors, because tensors
do not survive vLLM's `collective_rpc` arguments as objects.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import torch

from core.infra.weights import WeightReceiver, adapter_checksum, remote_method

DEFAULT_BUCKET_BYTES = 64 << 20
TIED_HEAD = "lm_head.weight"


def policy_weights(named: Iterable[tuple[str, torch.Tensor]], *, tied_embeddings: bool):
    """Yield (name, tensor) in the checkpoint naming vLLM expects.

    With tied embeddings the head and the embedding are one tensor; sending both
    lets whichever arrives second silently overwrite the first, so only the
    embedding is sent. Value-head tensors never go to the generators.
    """
    for name, tensor in named:
        if name.startswith("value_head.") or (tied_embeddings and name == TIED_HEAD):
            continue
        yield name, tensor


def to_buckets(named: Iterable[tuple[str, torch.Tensor]],
               bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[bytes]:
    """Serialise tensors into safetensors blobs of at most ~bucket_bytes each (one tensor may exceed)."""
    from safetensors.torch import save

    buckets, current, size = [], {}, 0
    for name, tensor in named:
        t = tensor.detach().to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > bucket_bytes:
            buckets.append(save(current))
            current, size = {}, 0
        current[name] = t
        size += nbytes
    if current:
        buckets.append(save(current))
    return buckets


class CPUWeightSync:
    """Push one serialised copy of the policy to every generator.

    generators: Ray actor handles of generators (``core.infra.weights.WeightReceiver``: ``load_weights``).
    """

    def __init__(self, generators: list, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.generators = list(generators)
        self.bucket_bytes = bucket_bytes

    def push(self, version: int, named: Iterable[tuple[str, torch.Tensor]], *,
             tied_embeddings: bool) -> dict:
        import ray

        t0 = time.perf_counter()
        buckets = to_buckets(policy_weights(named, tied_embeddings=tied_embeddings),
                             self.bucket_bytes)
        serialise_s = time.perf_counter() - t0
        ref = ray.put(buckets)  # one copy in the object store, shared by every generator
        # In the generators' weight-update concurrency group: with partial rollouts (async mode)
        # the push lands between two engine steps instead of after a whole generate call.
        results = ray.get([remote_method(g, WeightReceiver.load_weights).remote(version, ref)
                           for g in self.generators])
        for r in results:
            if r["version"] != version:
                raise RuntimeError(f"weight sync: a generator reports version {r['version']}, "
                                   f"expected {version}")
        return {"seconds": time.perf_counter() - t0, "serialise_seconds": serialise_s,
                "wait_seconds": max((r.get("wait_seconds", 0.0) for r in results), default=0.0),
                "bytes": sum(len(b) for b in buckets), "buckets": len(buckets),
                "generators": len(results), "version": version}


class AdapterNotLoaded(RuntimeError):
    """A generator's proof says a LoRA push did not land: the run must not train on what it serves."""


class AdapterSync:
    """Push the policy's LoRA adapter (PEFT's files, megabytes) to every generator through the
    object store, whatever ``learner.weight_sync`` is, and check what each one reports it holds.

    generators: replica id -> Ray actor handle (``core.infra.weights.WeightReceiver``: ``load_adapter``).
    """

    def __init__(self, generators: Mapping[str, object]) -> None:
        self.generators = dict(generators)

    def push(self, version: int, files: dict[str, bytes], *, modules: int) -> dict:
        """``modules``: the adapter modules the learner trains; each generator must bind them all."""
        import ray

        t0 = time.perf_counter()
        ref = ray.put(files)
        results = ray.get([remote_method(g, WeightReceiver.load_adapter).remote(version, ref)
                           for g in self.generators.values()])
        sent = adapter_checksum(files)
        for replica, report in zip(self.generators, results):
            check_adapter_report(replica, report, version=version, checksum=sent, modules=modules)
        return {"seconds": time.perf_counter() - t0, "bytes": sum(map(len, files.values())),
                "wait_seconds": max((r.get("wait_seconds", 0.0) for r in results), default=0.0),
                "generators": len(results), "version": version, "adapter_modules": modules}


def check_adapter_report(replica: str, report: dict, *, version: int, checksum: str, modules: int) -> None:
    """Raise AdapterNotLoaded, naming ``replica`` and what did not land, unless its report proves
    that it serves this push: the version, the files as sent, every adapter module bound, none stale."""
    where = f"LoRA push of version {version}: generator {replica}"
    if report.get("version") != version:
        raise AdapterNotLoaded(f"{where} reports version {report.get('version')}")
    if report.get("checksum") != checksum:
        raise AdapterNotLoaded(f"{where} received other files (checksum {report.get('checksum')}, sent {checksum})")
    if not report.get("bound"):
        raise AdapterNotLoaded(f"{where} bound 0 of the adapter's {modules} modules to its layers: it would serve "
                               "the base model (the engine does not take this model's adapter module names)")
    if report["bound"] != modules or report.get("unbound"):
        missing = report.get("unbound") or []
        raise AdapterNotLoaded(f"{where} bound {report['bound']} of {modules} adapter modules; not bound: "
                               f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    if report.get("stale"):
        stale = report["stale"]
        raise AdapterNotLoaded(f"{where} holds other tensors than were sent for {len(stale)} modules "
                               f"(e.g. {stale[0]}): the engine still serves an older adapter")

"""The learner -> generator weight contract: what a generator offers the learner's weight transports.

actors and learner never import each other, so the contract lives here: ``WeightReceiver`` lists
every generator method that learner code calls (learner/transport/base.py, learner/transport/vllm_api.py),
``actors.generator.Generator`` implements it (tests/actors/test_weight_contract.py checks the
signatures), and the learner reaches those methods through ``remote_method``, by the protocol's
own function objects rather than by name strings.

The learner calls them on Ray actor handles, in this order:

* "cpu" transport, every push: ``load_weights(version, buckets)`` on every generator at once.
* A LoRA adapter, every push and on every transport: ``load_adapter(version, files)`` on every
  generator at once (the adapter is megabytes: it always travels through the object store).
* "nccl" and "ipc" transports (vLLM's weight-transfer API), once per group:
  ``weight_transfer_gpus(transport)``, then ``init_weight_transfer(info)`` (all generators
  concurrently; NCCL: each blocks until every rank has joined); every push: ``version()``, then
  ``start_weight_update(version)``, ``update_weights(update_info)`` (NCCL: once; IPC: once per
  packed chunk), ``finish_weight_update(version)``, each started on all generators before
  waiting on any; ``shutdown_weight_transfer()`` when the group is released, which is also how
  a round that failed midway is given up.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Protocol

# The Ray concurrency group in which a generator actor takes weight updates, so that a
# push does not queue behind a generate call (actors/generator.py); the learner's weight
# transports call into it.
WEIGHT_UPDATE_GROUP = "weight_updates"


class WeightReceiver(Protocol):
    """The generator's side of a weight push. Versions only grow: an older one is refused."""

    def load_weights(self, version: int, buckets: list[bytes]) -> dict:
        """CPU transport: reload the policy in place from safetensors-serialised ``buckets`` and
        record ``version``. Returns at least {"version": version}, plus "seconds",
        "wait_seconds" (for the engine's turn), "tensors" and "bytes"."""

    def load_adapter(self, version: int, files: dict[str, bytes]) -> dict:
        """Serve the policy as the base model plus the LoRA adapter in ``files`` (PEFT's
        ``adapter_config.json`` and ``adapter_model.safetensors``: file name -> bytes) from now on,
        as ``version``. Returns the proof of what the engine holds: {"version", "checksum"
        (``adapter_checksum`` of the files received), "bound" (adapter modules the engine bound
        to its layers), "unbound" and "stale" (adapter modules it did not bind, or holds other
        tensors for: both empty when the push landed)}, plus "seconds", "wait_seconds", "bytes"."""

    def version(self) -> int:
        """The policy version loaded now (GPU transports: checked before a round touches any generator)."""

    def weight_transfer_gpus(self, transport: str) -> list[str]:
        """GPU transports: the GPU UUID of each engine worker, in worker-rank order (NCCL: one rank
        each; IPC: each must be the learner's GPU); refuses a ``transport`` it was not started with."""

    def init_weight_transfer(self, init_info: dict) -> None:
        """GPU transports: join the learner's group. ``init_info``: vLLM's init info of the backend
        as a dict (NCCL: NCCLWeightTransferInitInfo, ``rank_offset`` set per generator, blocks
        until every rank has joined; IPC: ``{"packed": ...}``)."""

    def start_weight_update(self, version: int) -> None:
        """GPU transports: open an update round for ``version`` (refuses an older one); holds the
        engine until finish_weight_update releases it, or the round is given up."""

    def update_weights(self, update_info: dict) -> None:
        """GPU transports: receive the tensors ``update_info`` names (names, dtype_names, shapes;
        IPC: one packed chunk's memory handle too); NCCL: blocks until the broadcast ends."""

    def finish_weight_update(self, version: int) -> dict:
        """GPU transports: close the round and record ``version``; returns at least {"version": version}."""

    def shutdown_weight_transfer(self) -> None:
        """GPU transports: leave the group, giving up a round left open (inference goes on)."""


# The calls that change the weights run in WEIGHT_UPDATE_GROUP; the others in the actor's default group.
IN_UPDATE_GROUP = frozenset({"load_weights", "load_adapter", "start_weight_update", "update_weights",
                             "finish_weight_update"})


def remote_method(handle, method: Callable):
    """``handle``'s Ray method for the ``WeightReceiver`` method ``method`` (e.g.
    ``remote_method(g, WeightReceiver.load_weights).remote(version, ref)``), in the
    weight-update concurrency group when the contract runs it there."""
    name = method.__name__
    if getattr(WeightReceiver, name, None) is not method:
        raise TypeError(f"{name} is not a method of the weight contract (core.infra.weights.WeightReceiver)")
    bound = getattr(handle, name)
    return bound.options(concurrency_group=WEIGHT_UPDATE_GROUP) if name in IN_UPDATE_GROUP else bound


def adapter_checksum(files: dict[str, bytes]) -> str:
    """One digest of an adapter's files: the learner's of what it sent, a generator's of what it received."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode())
        digest.update(files[name])
    return digest.hexdigest()[:16]

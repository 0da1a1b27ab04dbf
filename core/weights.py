"""The learner -> generator weight contract: what a generator offers the learner's weight transports.

actors and learner never import each other, so the contract lives here: ``WeightReceiver`` lists
every generator method that learner code calls (learner/weight_sync.py, learner/nccl_sync.py),
``actors.generator.Generator`` implements it (tests/actors/test_weight_contract.py checks the
signatures), and the learner reaches those methods through ``remote_method``, by the protocol's
own function objects rather than by name strings.

The learner calls them on Ray actor handles, in this order:

* "cpu" transport, every push: ``load_weights(version, buckets)`` on every generator at once.
* "nccl" transport, once per group: ``weight_transfer_gpus()``, then ``init_weight_transfer(info)``
  (all generators concurrently: each blocks until every rank has joined);
  every push: ``version()``, then ``start_weight_update(version)``, ``update_weights(update_info)``,
  ``finish_weight_update(version)``, each started on all generators before waiting on any;
  ``shutdown_weight_transfer()`` when the group is released.
"""
from __future__ import annotations

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

    def version(self) -> int:
        """The policy version loaded now (NCCL: checked before a round touches any generator)."""

    def weight_transfer_gpus(self) -> list[str]:
        """NCCL: the GPU UUID of each engine worker, in worker-rank order (one NCCL rank each)."""

    def init_weight_transfer(self, init_info: dict) -> None:
        """NCCL: join the learner's group; blocks until every rank has joined. ``init_info``:
        vLLM's NCCLWeightTransferInitInfo as a dict, ``rank_offset`` set per generator."""

    def start_weight_update(self, version: int) -> None:
        """NCCL: open an update round for ``version`` (refuses an older one); holds the engine
        until finish_weight_update, or a failure, releases it."""

    def update_weights(self, update_info: dict) -> None:
        """NCCL: receive every tensor ``update_info`` names (names, dtype_names, shapes); blocks
        until the broadcast ends."""

    def finish_weight_update(self, version: int) -> dict:
        """NCCL: close the round and record ``version``; returns at least {"version": version}."""

    def shutdown_weight_transfer(self) -> None:
        """NCCL: leave the group (inference goes on)."""


# The calls that change the weights run in WEIGHT_UPDATE_GROUP; the others in the actor's default group.
IN_UPDATE_GROUP = frozenset({"load_weights", "start_weight_update", "update_weights", "finish_weight_update"})


def remote_method(handle, method: Callable):
    """``handle``'s Ray method for the ``WeightReceiver`` method ``method`` (e.g.
    ``remote_method(g, WeightReceiver.load_weights).remote(version, ref)``), in the
    weight-update concurrency group when the contract runs it there."""
    name = method.__name__
    if getattr(WeightReceiver, name, None) is not method:
        raise TypeError(f"{name} is not a method of the weight contract (core.weights.WeightReceiver)")
    bound = getattr(handle, name)
    return bound.options(concurrency_group=WEIGHT_UPDATE_GROUP) if name in IN_UPDATE_GROUP else bound

"""GPU weight transports on vLLM's weight-transfer API (``vllm.distributed.weight_transfer``).

Two of that API's backends are tether transports, and this module is what they share:
"nccl" (learner/transport/nccl.py: a broadcast from learner rank 0 to generators on other GPUs)
and "ipc" (learner/transport/ipc.py: CUDA IPC handles to generators on learner rank 0's own GPU).

* trainer side: ``WeightTransferTrainerFactory.trainer_init(<backend>TrainerInitInfo, client,
  source)`` builds vLLM's trainer engine and has every generator join
  (``init_weight_transfer_engine``); each push is one ``send_weights()``, which drives
  ``start_weight_update``, ``update_weights`` (once, or once per packed chunk) and
  ``finish_weight_update`` through ``client``.
* ``client`` is ``GeneratorClient``: vLLM's ``VLLMWeightSyncClient`` protocol over tether's
  generator actors (``core.infra.weights.WeightReceiver``), which forward to their ``LLM``
  (actors/weight_receiver.py); ``source`` is a ``WeightSource`` refilled before each round.

A round that failed after reaching the generators leaves the transfer state unusable (vLLM:
the caller must tear it down), so it is torn down at once: every generator is asked to leave
(best effort: one may be dead) and vLLM's engine is shut down. The next push forms it again
with the generators it is given then (``set_generators``). A round that failed before touching
any generator (an older version refused, a generator already dead) keeps it.

vLLM and CUDA are imported lazily: this module imports on a CPU-only machine.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Optional

import torch

from core.infra.errors import type_and_first_line
from core.infra.weights import WeightReceiver, remote_method
from learner.transport.base import DEFAULT_BUCKET_BYTES, policy_weights

log = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 60.0  # a generator stuck in a broken collective must not hold the learner forever


class GeneratorLost(RuntimeError):
    """A generator died during a weight push; the caller replaces it and pushes again."""


def named_generators(generators) -> dict:
    """replica id -> actor handle; a plain list is named generator-0, generator-1, ..."""
    if isinstance(generators, Mapping):
        return dict(generators)
    return {f"generator-{i}": g for i, g in enumerate(generators)}


def wait_all(refs: list, names: Sequence[str], what: str) -> list:
    """Results in order. Every call was started before this waits on any (NCCL: all ranks must be
    inside the same collective together); the first failure raises in one line, naming its generator."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    name_of, pending = dict(zip(refs, names)), list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(ready[0])
        except RayActorError as e:
            raise GeneratorLost(f"weight sync: {name_of[ready[0]]} died during {what} ({type_and_first_line(e)}); "
                                "replace it: the next push forms the group with the generators it is given") from e
        except RayTaskError as e:
            cause = e.cause if getattr(e, "cause", None) is not None else e
            kind = ValueError if isinstance(cause, ValueError) else RuntimeError
            raise kind(f"weight sync: {name_of[ready[0]]} failed in {what}: {type_and_first_line(cause)}") from e
    return ray.get(list(refs))


def meta_nbytes(meta: list) -> list[int]:
    """Bytes of each tensor a round sends (vLLM ParamMeta: dtype and full shape)."""
    return [m.dtype.itemsize * math.prod(m.shape) for m in meta]


def release(generators: Mapping[str, object], timeout_s: float = RELEASE_TIMEOUT_S) -> None:
    """Best effort: every generator leaves the transfer group; a dead or stuck one is logged, not raised."""
    import ray

    refs = {remote_method(g, WeightReceiver.shutdown_weight_transfer).remote(): name for name, g in generators.items()}
    if not refs:
        return
    ready, stuck = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    for ref in ready:
        try:
            ray.get(ref)
        except Exception as e:  # noqa: BLE001 - a dead generator is why we are here
            log.warning("weight sync: %s could not leave the transfer group: %s", refs[ref], type_and_first_line(e))
    for ref in stuck:
        log.warning("weight sync: %s did not leave the transfer group within %.0fs", refs[ref], timeout_s)


class GeneratorClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol (``weight_transfer/base.py``) over tether generators.

    ``offsets`` (NCCL): vLLM's trainer engine tells the workers ``rank_offset=1`` (it assumes one
    engine); it is rewritten per generator here. None (IPC): the init info goes unchanged.
    The protocol carries no policy version, so it rides on ``self.version``: start refuses an
    older one before touching any generator (the group stays usable), finish records it on
    each generator (which also drops its prefix cache). ``touched`` turns True once a round has
    reached the generators. The calls run in the generators' weight-update concurrency group
    (``remote_method``), so none queues behind a generate call (actors/generator.py).
    """

    def __init__(self, generators, offsets: Optional[list[int]] = None) -> None:
        named = named_generators(generators)
        self.names, self.generators = list(named), list(named.values())
        self.offsets = None if offsets is None else list(offsets)
        self.version: int = 0
        self.results: list[dict] = []
        self.touched = False
        self._closed, self._lock = False, threading.Lock()

    def close(self) -> None:
        """No call of this client reaches a generator from now on. vLLM leaves a failed round's
        update_weights running on a thread of its own: sent late, it would land in the next round."""
        with self._lock:
            self._closed = True

    def _send(self, method, args_per_generator: list) -> list:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"weight sync: {method.__name__} after the group was torn down")
            refs = [remote_method(g, method).remote(*args) for g, args in zip(self.generators, args_per_generator)]
        return wait_all(refs, self.names, method.__name__)

    def _each(self, method, *args) -> list:
        return self._send(method, [args] * len(self.generators))

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        if self.offsets is None:
            self._each(WeightReceiver.init_weight_transfer, init_info)
            return
        self._send(WeightReceiver.init_weight_transfer, [({**init_info, "rank_offset": off},) for off in self.offsets])

    def start_weight_update(self) -> None:
        loaded = dict(zip(self.names, self._each(WeightReceiver.version)))
        newest = max(loaded, key=loaded.get, default=None)
        if newest is not None and loaded[newest] > self.version:
            raise ValueError(f"weight sync: version {self.version} is older than the loaded version "
                             f"{loaded[newest]} of {newest}")
        self.touched = True
        self._each(WeightReceiver.start_weight_update, self.version)

    def update_weights(self, update_info: dict) -> None:
        self._each(WeightReceiver.update_weights, update_info)

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self.results = self._each(WeightReceiver.finish_weight_update, self.version)


def round_source(device=None):
    """A vLLM ``WeightSource`` whose (metadata, tensors) are refilled before each round;
    tensors are moved to ``device`` (default: the current CUDA device) as they are sent."""
    from vllm.distributed.weight_transfer.base import WeightSource

    class RoundSource(WeightSource):
        def __init__(self) -> None:
            self.meta, self.pairs = [], iter(())

        def metadata(self):
            return self.meta

        def __iter__(self):
            dev = device or torch.device("cuda", torch.cuda.current_device())
            for name, tensor in self.pairs:  # ZeRO-3 gathers arrive on the CPU
                yield name, tensor.to(dev)

    return RoundSource()


class VLLMWeightSync:
    """Same interface as ``CPUWeightSync``; holds vLLM's transfer state across pushes.

    generators: replica id -> Ray actor handle of a ``core.infra.weights.WeightReceiver`` started with
    the same ``weight_sync`` (a list is named by position). Runs in learner rank 0, which must
    own a CUDA device. A subclass names its ``transport`` and fills in the ``_`` hooks below.
    """

    transport = ""

    def __init__(self, generators, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.generators = named_generators(generators)
        self.bucket_bytes = int(bucket_bytes)  # fixed at init: both sides cut chunks by it
        self._engine = self._client = self._source = None
        self.broken: Optional[str] = None  # why the last group was torn down mid-round

    @property
    def engine(self):
        """vLLM's trainer-side transfer engine of the current group; None while no group is formed
        (the next push forms one)."""
        return self._engine

    def set_generators(self, generators) -> None:
        """The generators of the next push; a different set (a replacement, a resize) tears the
        current group down, and the next push forms one with these."""
        new = named_generators(generators)
        if list(new.items()) != list(self.generators.items()):
            self.shutdown()
            self.generators = new

    def init(self, meta: list) -> None:
        """Form the transfer group with every generator's workers; ``meta``: the round's ParamMeta."""
        learner_gpu = self._learner_gpu()
        gpus = wait_all([remote_method(g, WeightReceiver.weight_transfer_gpus).remote(self.transport)
                         for g in self.generators.values()], list(self.generators), "weight_transfer_gpus")
        self._check_gpus(learner_gpu, dict(zip(self.generators, gpus)))
        self._client = GeneratorClient(self.generators, self._rank_offsets(gpus))
        self._source = round_source(self._device())
        try:
            self._engine = self._open(meta)
        except BaseException:
            self._client.close()  # vLLM's rendezvous thread may still be sending the init
            self._client = self._source = None
            release(self.generators)  # some may have joined a group that will never form
            raise
        self.broken = None

    def push(self, version: int, named: Iterable[tuple[str, torch.Tensor]], *, tied_embeddings: bool,
             metadata: Optional[Sequence[tuple[str, torch.dtype, tuple]]] = None) -> dict:
        """Send the policy to every generator; returns the same report as CPUWeightSync.

        metadata: (name, dtype, full shape) of every tensor ``named`` will yield, in order.
        With it the tensors stream (ZeRO-3 gathers interleave with the transfer); without
        it ``named`` is materialised first (views of live weights under ZeRO 0-2: no copy).
        """
        pairs = policy_weights(named, tied_embeddings=tied_embeddings)
        try:
            return self._push(version, pairs, metadata, tied_embeddings)
        finally:
            for _ in pairs:  # on early failure: other ZeRO-3 ranks wait in the gathers that feed `named`
                pass

    def _push(self, version, pairs, metadata, tied_embeddings) -> dict:
        if not self.generators:  # nobody to send to (push drains `named`)
            return {"seconds": 0.0, "init_seconds": 0.0, "bytes": 0, "buckets": 0, "generators": 0,
                    "version": version, "transport": self.transport}
        if metadata is None:
            pairs = list(pairs)
            metadata = [(n, t.dtype, tuple(t.shape)) for n, t in pairs]
        meta = self._param_meta(metadata, tied_embeddings)
        init_s = 0.0
        if self._engine is None:
            t0 = time.perf_counter()
            self.init(meta)
            init_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        results = self._round(version, meta, pairs)
        for r in results:
            if r["version"] != version:
                raise RuntimeError(f"weight sync: a generator reports version {r['version']}, expected {version}")
        sizes = meta_nbytes(meta)
        return {"seconds": time.perf_counter() - t0, "init_seconds": init_s, "bytes": sum(sizes),
                "buckets": self._chunks(sizes), "generators": len(results), "version": version,
                "transport": self.transport}

    def _round(self, version: int, meta: list, pairs) -> list[dict]:
        """One send_weights(); a failure after the generators were touched tears the group down."""
        self._source.meta, self._source.pairs = meta, iter(pairs)
        self._client.version, self._client.touched = int(version), False
        if torch.cuda.is_available():  # vLLM sends from its own streams: let the optimizer's kernels land
            torch.cuda.current_stream().synchronize()
        try:
            self._engine.send_weights()
        except BaseException as e:
            if self._client.touched:
                self.broken = type_and_first_line(e)
                log.warning("weight sync: a %s round failed after reaching the generators (%s); tearing the "
                            "group down, the next push forms a new one", self.transport, self.broken)
                self.shutdown()
            raise
        results, self._client.results = self._client.results, []
        return results

    @staticmethod
    def _param_meta(metadata, tied_embeddings: bool) -> list:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(n, d, tuple(int(x) for x in s))
                for n, (d, s) in policy_weights(((n, (d, s)) for n, d, s in metadata),
                                                tied_embeddings=tied_embeddings)]

    def shutdown(self) -> None:
        """Release the group on both sides (best effort: a dead generator is logged); a later push re-inits."""
        engine, client = self._engine, self._client
        self._engine, self._client, self._source = None, None, None
        if client is not None:
            client.close()
        if engine is None:
            return
        release(self.generators)
        try:
            engine.shutdown()
        except Exception as e:  # noqa: BLE001 - the next init forms a fresh one either way
            log.warning("weight sync: shutting down vLLM's %s trainer engine failed: %s", self.transport,
                        type_and_first_line(e))

    # ---- the transport's specifics
    def _learner_gpu(self) -> str:
        """This rank's GPU UUID; the one-line error without CUDA."""
        if not torch.cuda.is_available():
            raise ValueError(f"weight_sync={self.transport!r} needs CUDA on learner rank 0; use weight_sync='cpu'")
        return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)

    def _device(self):
        return None  # the current CUDA device

    def _check_gpus(self, learner_gpu: str, generator_gpus: Mapping[str, list[str]]) -> None:
        raise NotImplementedError

    def _rank_offsets(self, generator_gpus: list[list[str]]) -> Optional[list[int]]:
        raise NotImplementedError

    def _open(self, meta: list):
        """vLLM's trainer engine, every generator joined (``trainer_init``)."""
        raise NotImplementedError

    def _chunks(self, sizes: list[int]) -> int:
        raise NotImplementedError

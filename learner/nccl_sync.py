"""GPU weight transport: NCCL broadcast from learner rank 0 to every generator's vLLM worker(s).

Built on vLLM's weight-transfer engine (``vllm.distributed.weight_transfer``, backend "nccl"):

* trainer side: ``WeightTransferTrainerFactory.trainer_init(NCCLTrainerInitInfo, client, source)``
  opens NCCL rank 0 (a ``StatelessProcessGroup`` TCP rendezvous at the learner's address) and
  has every worker join; ``send_weights()`` then drives one round: ``start_weight_update``,
  ``update_weights`` (the metadata of ALL tensors, run concurrently with the broadcast) and
  ``finish_weight_update``. Tensors travel packed into uint8 buffers of ~``bucket_bytes``
  (``packed_nccl_broadcast_producer``), double-buffered on side streams.
* generator side: the engine must be started with ``weight_transfer_config`` (backend "nccl"),
  which ``actors.generator.Generator`` does when started with ``weight_sync="nccl"`` (the
  pools pass ``learner.weight_sync``); the methods this module calls on it are those of the
  weight contract, ``core.weights.WeightReceiver`` (``init_weight_transfer`` /
  ``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` forward to vLLM's
  ``LLM`` methods of the same names).

So a push costs three small RPCs per generator (metadata only), never one per parameter or
per bucket; the bytes go over NCCL. NCCL refuses two ranks of one communicator on the same
GPU, so the learner and the generators need distinct GPUs (checked up front, by GPU UUID).

vLLM and CUDA are imported lazily: this module imports on a CPU-only machine.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Sequence
from typing import Optional

import torch

from core.errors import type_and_first_line
from core.weights import WeightReceiver, remote_method
from learner.rendezvous import candidate_port, is_address_in_use, node_ip
from learner.weight_sync import DEFAULT_BUCKET_BYTES, policy_weights

log = logging.getLogger(__name__)

NUM_BUFFERS = 2  # vLLM's default double buffering (packed_tensor.DEFAULT_PACKED_NUM_BUFFERS)
PORT_ATTEMPTS = 3  # fresh rendezvous ports tried when one turns out taken


def packing_plan(nbytes: Sequence[int], bucket_bytes: int) -> list[int]:
    """Tensors per packed chunk, by vLLM's rule (``packed_tensor.pack_tensors`` and
    ``packed_nccl_broadcast_consumer``): a chunk takes tensors until its size EXCEEDS
    ``bucket_bytes``, the tensor that crosses the line included. Used for the report."""
    chunks, count, size = [], 0, 0
    for n in nbytes:
        count, size = count + 1, size + int(n)
        if size > bucket_bytes:
            chunks.append(count)
            count, size = 0, 0
    if count:
        chunks.append(count)
    return chunks


def rank_layout(workers_per_generator: Sequence[int]) -> tuple[list[int], int]:
    """(NCCL rank of each generator's worker 0, group size). Learner rank 0 is NCCL rank 0.

    vLLM places a worker at ``rank_offset + dp_rank * (tp * pp) + worker_rank``: one engine
    per offset. Each tether generator is its own engine, so each gets its own offset.
    """
    offsets, nxt = [], 1
    for n in workers_per_generator:
        if n < 1:
            raise ValueError(f"weight sync: a generator reports {n} vLLM workers")
        offsets.append(nxt)
        nxt += n
    return offsets, nxt


def check_distinct_gpus(learner_gpu: str, generator_gpus: Sequence[Sequence[str]]) -> None:
    """NCCL refuses a communicator with two ranks on one GPU ("Duplicate GPU detected")."""
    seen = {learner_gpu: "learner rank 0"}
    for i, gpus in enumerate(generator_gpus):
        for w, uuid in enumerate(gpus):
            who = f"generator {i} worker {w}"
            if uuid in seen:
                raise ValueError(f"weight_sync='nccl': {seen[uuid]} and {who} share GPU {uuid}; NCCL cannot "
                                 "put two ranks on one GPU: give them separate GPUs or use weight_sync='cpu'")
            seen[uuid] = who


def _get(refs: list) -> list:
    """Wait for calls started on every generator at once: all must be inside the same NCCL
    call together, so each round is started on all of them before waiting on any."""
    import ray
    return ray.get(refs)


class GeneratorClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol (``weight_transfer/base.py``) over tether generators
    (Ray actor handles of ``core.weights.WeightReceiver``, in replica order).

    vLLM's trainer engine tells the workers ``rank_offset=1`` (it assumes one engine); the
    offset is rewritten per generator here (``rank_layout``). The protocol carries no policy
    version, so it rides on ``self.version``: start refuses an older one on every generator
    before touching any (the group stays usable), finish records it on the generator (which
    also drops its prefix cache). ``touched`` turns True once a round has reached the workers.
    A round's calls run in the generators' weight-update concurrency group (``remote_method``),
    so none queues behind a generate call (actors/generator.py).
    """

    def __init__(self, generators: list, offsets: list[int]) -> None:
        self.generators, self.offsets = list(generators), list(offsets)
        self.version: int = 0
        self.results: list[dict] = []
        self.touched = False

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        _get([remote_method(g, WeightReceiver.init_weight_transfer).remote({**init_info, "rank_offset": off})
              for g, off in zip(self.generators, self.offsets)])

    def start_weight_update(self) -> None:
        loaded = _get([remote_method(g, WeightReceiver.version).remote() for g in self.generators])
        if max(loaded, default=0) > self.version:
            raise ValueError(f"weight sync: version {self.version} is older than the loaded version "
                             f"{max(loaded)} of a generator")
        self.touched = True
        _get([remote_method(g, WeightReceiver.start_weight_update).remote(self.version) for g in self.generators])

    def update_weights(self, update_info: dict) -> None:
        _get([remote_method(g, WeightReceiver.update_weights).remote(update_info) for g in self.generators])

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self.results = _get([remote_method(g, WeightReceiver.finish_weight_update).remote(self.version)
                             for g in self.generators])


def _round_source(device=None):
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


class NCCLWeightSync:
    """Same interface as ``CPUWeightSync``; holds the NCCL group across pushes (``init`` once).

    generators: Ray actor handles of ``core.weights.WeightReceiver`` (``actors.generator.Generator``)
    started with ``weight_sync="nccl"`` (``learner.weight_sync``), in replica order. Runs in learner rank
    0, which must own a CUDA device.
    """

    def __init__(self, generators: list, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.generators = list(generators)
        self.bucket_bytes = int(bucket_bytes)  # fixed at init: both sides cut chunks by it
        self._engine = self._client = self._source = None
        self._broken: Optional[str] = None

    def init(self, master_address: Optional[str] = None, master_port: Optional[int] = None) -> dict:
        """Form the NCCL group {learner rank 0} + every generator worker; blocks until all joined.

        vLLM binds the rendezvous port itself, after the generators were told it: without
        ``master_port`` a candidate port is drawn, and a fresh one if it turns out taken.
        """
        if not torch.cuda.is_available():
            raise ValueError("weight_sync='nccl' needs CUDA on learner rank 0; use weight_sync='cpu'")
        gpus = _get([remote_method(g, WeightReceiver.weight_transfer_gpus).remote() for g in self.generators])
        check_distinct_gpus(str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid), gpus)
        offsets, world = rank_layout([len(g) for g in gpus])
        address = master_address or node_ip()
        attempts = 1 if master_port else PORT_ATTEMPTS
        for attempt in range(1, attempts + 1):
            port = int(master_port or candidate_port())
            try:
                self._open(address, port, offsets, world)
                break
            except Exception as e:
                if attempt == attempts or not is_address_in_use(e):
                    raise
                log.warning("weight sync: NCCL rendezvous port %d is taken (%s); retrying with a fresh port "
                            "(attempt %d/%d)", port, type_and_first_line(e), attempt + 1, attempts)
                self._release_generators()
        return {"world_size": world, "rank_offsets": offsets, "address": f"{address}:{port}"}

    def _open(self, address: str, port: int, offsets: list[int], world: int) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        self._client, self._source = GeneratorClient(self.generators, offsets), _round_source()
        info = NCCLTrainerInitInfo(master_address=address, master_port=port, world_size=world, rank=0,
                                   packed=True, packed_buffer_size_bytes=self.bucket_bytes,
                                   packed_num_buffers=NUM_BUFFERS)
        self._engine = WeightTransferTrainerFactory.trainer_init(info, client=self._client, source=self._source)

    def _release_generators(self) -> None:
        """Best effort: the generators may hold a half-formed group from the failed attempt."""
        try:
            _get([remote_method(g, WeightReceiver.shutdown_weight_transfer).remote() for g in self.generators])
        except Exception as e:  # noqa: BLE001 - the next attempt reports what still fails
            log.warning("weight sync: releasing the generators' transfer group failed: %s", type_and_first_line(e))

    def push(self, version: int, named: Iterable[tuple[str, torch.Tensor]], *, tied_embeddings: bool,
             metadata: Optional[Sequence[tuple[str, torch.dtype, tuple]]] = None) -> dict:
        """Broadcast the policy to every generator; returns the same report as CPUWeightSync.

        metadata: (name, dtype, full shape) of every tensor ``named`` will yield, in order.
        With it the tensors stream (ZeRO-3 gathers interleave with the broadcast); without
        it ``named`` is materialised first (views of live weights under ZeRO 0-2: no copy).
        """
        pairs = policy_weights(named, tied_embeddings=tied_embeddings)
        try:
            return self._push(version, pairs, metadata, tied_embeddings)
        finally:
            for _ in pairs:  # on early failure: other ZeRO-3 ranks wait in the gathers that feed `named`
                pass

    def _push(self, version, pairs, metadata, tied_embeddings) -> dict:
        if self._broken:
            raise RuntimeError(f"NCCL weight sync is unusable after an earlier failure ({self._broken}); "
                               "restart the learner and generators")
        if not self.generators:  # nobody to send to (push drains `named`)
            return {"seconds": 0.0, "init_seconds": 0.0, "bytes": 0, "buckets": 0, "generators": 0,
                    "version": version, "transport": "nccl"}
        init_s = 0.0
        if self._engine is None:
            t0 = time.perf_counter()
            self.init()
            init_s = time.perf_counter() - t0
        from vllm.distributed.weight_transfer.base import ParamMeta

        t0 = time.perf_counter()
        if metadata is None:
            pairs = list(pairs)
            metadata = [(n, t.dtype, tuple(t.shape)) for n, t in pairs]
        meta = [ParamMeta(n, d, tuple(int(x) for x in s))
                for n, (d, s) in policy_weights(((n, (d, s)) for n, d, s in metadata),
                                                tied_embeddings=tied_embeddings)]
        self._source.meta, self._source.pairs = meta, iter(pairs)
        self._client.version, self._client.touched = int(version), False
        if torch.cuda.is_available():  # vLLM packs on its own streams: let the optimizer's kernels land
            torch.cuda.current_stream().synchronize()
        try:
            self._engine.send_weights()
        except BaseException as e:
            if self._client.touched:  # failed mid-round: vLLM says the group must be torn down
                self._broken = f"{type(e).__name__}: {e}"
            raise
        results, self._client.results = self._client.results, []
        for r in results:
            if r["version"] != version:
                raise RuntimeError(f"weight sync: a generator reports version {r['version']}, expected {version}")
        sizes = [m.dtype.itemsize * math.prod(m.shape) for m in meta]
        return {"seconds": time.perf_counter() - t0, "init_seconds": init_s, "bytes": sum(sizes),
                "buckets": len(packing_plan(sizes, self.bucket_bytes)),
                "generators": len(results), "version": version, "transport": "nccl"}

    def shutdown(self) -> None:
        """Release the NCCL group on both sides (best effort); a later push re-inits."""
        if self._engine is not None:
            try:
                _get([remote_method(g, WeightReceiver.shutdown_weight_transfer).remote() for g in self.generators])
            finally:
                self._engine.shutdown()
                self._engine = None


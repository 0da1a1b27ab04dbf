"""GPU weight transport "nccl": a broadcast from learner rank 0 to every generator's vLLM worker(s).

vLLM's weight-transfer API, backend "nccl" (learner/transport/vllm_api.py has what it shares with "ipc"):
``trainer_init(NCCLTrainerInitInfo)`` opens NCCL rank 0 (a ``StatelessProcessGroup`` TCP
rendezvous at the learner's address) and has every worker join; in each round
``update_weights`` carries the metadata of ALL tensors and runs concurrently with the
broadcast, the tensors packed into uint8 buffers of ~``bucket_bytes``
(``packed_nccl_broadcast_producer``), double-buffered on side streams. The generators run
``WeightTransferConfig(backend="nccl")`` (actors.generator.Generator with weight_sync="nccl").

So a push costs three small RPCs per generator (metadata only), never one per parameter or
per bucket; the bytes go over NCCL. NCCL refuses two ranks of one communicator on the same
GPU, so the learner and the generators need distinct GPUs (checked up front, by GPU UUID);
one GPU for both is what the "ipc" transport is for.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from core.infra.errors import type_and_first_line
from learner.rendezvous import candidate_port, is_address_in_use, node_ip
from learner.transport.vllm_api import VLLMWeightSync, release

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


def check_distinct_gpus(learner_gpu: str, generator_gpus: Mapping[str, Sequence[str]]) -> None:
    """NCCL refuses a communicator with two ranks on one GPU ("Duplicate GPU detected").
    generator_gpus: replica id -> the GPU UUID of each of its vLLM workers."""
    seen = {learner_gpu: "learner rank 0"}
    for name, gpus in generator_gpus.items():
        for w, uuid in enumerate(gpus):
            who = f"{name} worker {w}"
            if uuid in seen:
                raise ValueError(f"weight_sync='nccl': {seen[uuid]} and {who} share GPU {uuid}; NCCL cannot put two "
                                 "ranks on one GPU: give them separate GPUs, or with one GPU for both use "
                                 "weight_sync='ipc'")
            seen[uuid] = who


class NCCLWeightSync(VLLMWeightSync):
    """vLLM's NCCL weight transfer: the group {learner rank 0} + every generator worker."""

    transport = "nccl"

    def _check_gpus(self, learner_gpu, generator_gpus) -> None:
        check_distinct_gpus(learner_gpu, generator_gpus)

    def _rank_offsets(self, generator_gpus):
        offsets, self._world = rank_layout([len(g) for g in generator_gpus])
        return offsets

    def _chunks(self, sizes) -> int:
        return len(packing_plan(sizes, self.bucket_bytes))

    def _open(self, meta):
        """vLLM binds the rendezvous port itself, after the generators were told it: a candidate
        port is drawn, and a fresh one if it turns out taken."""
        address = node_ip()
        for attempt in range(1, PORT_ATTEMPTS + 1):
            port = int(candidate_port())
            try:
                return self._trainer_init(address, port)
            except Exception as e:
                if attempt == PORT_ATTEMPTS or not is_address_in_use(e):
                    raise
                log.warning("weight sync: NCCL rendezvous port %d is taken (%s); retrying with a fresh port "
                            "(attempt %d/%d)", port, type_and_first_line(e), attempt + 1, PORT_ATTEMPTS)
                release(self.generators)  # they may hold a half-formed group from the failed attempt

    def _trainer_init(self, address: str, port: int):
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        info = NCCLTrainerInitInfo(master_address=address, master_port=port, world_size=self._world, rank=0,
                                   packed=True, packed_buffer_size_bytes=self.bucket_bytes,
                                   packed_num_buffers=NUM_BUFFERS)
        return WeightTransferTrainerFactory.trainer_init(info, client=self._client, source=self._source)

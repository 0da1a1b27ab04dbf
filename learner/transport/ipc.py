"""GPU weight transport "ipc": CUDA IPC handles from learner rank 0 to generators on its own GPU.

For one GPU shared by the learner and the generators, where NCCL refuses to run (two ranks of
one communicator on one GPU). vLLM's weight-transfer API, backend "ipc" (learner/transport/vllm_api.py
has what it shares with "nccl"): ``trainer_init(IPCTrainerInitInfo)`` needs no rendezvous and
only tells every generator ``{"packed": True}``; in each round vLLM's producer copies the
tensors, chunk by chunk, into one GPU buffer it shares by a CUDA IPC handle, and each chunk is
one ``update_weights`` call carrying the handle (a pickled dict keyed by GPU UUID: it crosses
Ray and vLLM's engine process as bytes) and the chunk's metadata; the generator's vLLM worker
maps the buffer and copies the tensors out before the next chunk overwrites it. The
generators run ``WeightTransferConfig(backend="ipc")`` (actors.generator.Generator with
weight_sync="ipc").

A handle opens only on the GPU that made it, so every generator worker must be on learner
rank 0's GPU (checked up front, by GPU UUID): on Ray, give the learner and the generator
fractions of one GPU (``num_gpus: 0.5`` each). The buffer must hold the largest tensor, so
it is ``max(bucket_bytes, largest tensor)``: memory on the shared GPU stays bounded by it.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from learner.transport.vllm_api import VLLMWeightSync, meta_nbytes


def ipc_buffer_bytes(nbytes: Sequence[int], bucket_bytes: int) -> int:
    """The IPC buffer: vLLM's producer refuses a tensor larger than it."""
    return max([int(bucket_bytes), *map(int, nbytes)])


def ipc_packing_plan(nbytes: Sequence[int], buffer_bytes: int) -> list[int]:
    """Tensors per chunk, by vLLM's rule (``packed_tensor.packed_ipc_producer``): a chunk takes
    tensors while they FIT in ``buffer_bytes``; the one that would not fit starts the next."""
    chunks, count, size = [], 0, 0
    for n in map(int, nbytes):
        if n > buffer_bytes:
            raise ValueError(f"weight sync: a {n}-byte tensor does not fit the {buffer_bytes}-byte IPC buffer")
        if size and size + n > buffer_bytes:
            chunks.append(count)
            count, size = 0, 0
        count, size = count + 1, size + n
    if size:
        chunks.append(count)
    return chunks


def check_same_gpu(learner_gpu: str, generator_gpus: Mapping[str, Sequence[str]]) -> None:
    """A CUDA IPC handle opens only on the GPU that made it (vLLM looks its own GPU UUID up in it).
    generator_gpus: replica id -> the GPU UUID of each of its vLLM workers."""
    for name, gpus in generator_gpus.items():
        for w, uuid in enumerate(gpus):
            if uuid != learner_gpu:
                raise ValueError(f"weight_sync='ipc': {name} worker {w} is on GPU {uuid}, not on learner rank 0's "
                                 f"GPU {learner_gpu}; CUDA IPC shares memory within one GPU: put them on the same "
                                 "GPU (e.g. num_gpus 0.5 each) or use weight_sync='nccl'")


def check_single_rank() -> None:
    """vLLM's IPC trainer all-gathers handles over the default process group in every round,
    while only tether's rank 0 pushes: with more ranks that would wait forever."""
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        raise ValueError(f"weight_sync='ipc' needs a learner of one rank (this one has "
                         f"{torch.distributed.get_world_size()}): set learner.replicas=1 or use weight_sync='nccl'")


class IPCWeightSync(VLLMWeightSync):
    """vLLM's CUDA IPC weight transfer to generators on learner rank 0's GPU."""

    transport = "ipc"
    buffer_bytes = 0  # set when the group forms: the buffer must hold the largest tensor

    def _check_gpus(self, learner_gpu, generator_gpus) -> None:
        check_same_gpu(learner_gpu, generator_gpus)

    def _rank_offsets(self, generator_gpus):
        return None  # no rendezvous: the init info goes to every generator unchanged

    def _chunks(self, sizes) -> int:
        return len(ipc_packing_plan(sizes, self.buffer_bytes))

    def _init_info(self, meta):
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        check_single_rank()
        self.buffer_bytes = ipc_buffer_bytes(meta_nbytes(meta), self.bucket_bytes)
        return IPCTrainerInitInfo(rank=0, packed=True, packed_buffer_size_bytes=self.buffer_bytes)

    def _open(self, meta):
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        return WeightTransferTrainerFactory.trainer_init(self._init_info(meta), client=self._client,
                                                         source=self._source)

"""Test stand-ins around the GPU weight transports (learner/transport/vllm_api.py), for rounds on the CPU.

Each replaces only what needs a GPU and keeps vLLM's own code for the rest:

* ``RecordedNCCLSync``: tether's NCCL transport on vLLM's real trainer engine, the broadcast
  recorded instead of sent (no NCCL group on the CPU);
* ``HostIPCSync``: tether's IPC transport on vLLM's real IPC trainer engine, whose CUDA parts
  (device lookup, the IPC buffer, ipc_collect) are replaced by ``HostIPCTrainer`` and
  ``host_ipc_producer`` (chunks cut by vLLM's rule, the packed bytes standing in for the handle);
* ``GlooLearner`` / ``GlooGenerator``: the NCCL transport end to end over torch.distributed's
  gloo: vLLM's trainer and worker engines, its packed producer and consumer, with their
  communicator (``GlooBroadcast``) and CUDA streams (``host_accelerator``) replaced.

conftest.py registers this module with Ray's pickler by value: Ray workers cannot import tests.
"""
from __future__ import annotations

import torch

from learner.transport.base import policy_weights
from learner.transport.ipc import IPCWeightSync
from learner.transport.nccl import NCCLWeightSync

LEARNER_GPU = "GPU-learner"


def calls(generator) -> list:
    """What reached a fake generator (conftest.py's fake_generators), in order: (kind, argument)."""
    import ray
    return ray.get(generator.calls_.remote())


def lm_state(seed=0):
    """A small LM state: a tied head (the embedding's tensor), a bf16 tensor, a value head."""
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(64, 8, generator=g)
    return [("model.embed_tokens.weight", emb), ("model.layers.0.mlp.weight", torch.randn(8, 8, generator=g)),
            ("model.norm.weight", torch.randn(8, generator=g).to(torch.bfloat16)),
            ("lm_head.weight", emb), ("value_head.weight", torch.randn(1, 8, generator=g))]


def policy_state(policy_path: str) -> list[tuple[str, torch.Tensor]]:
    """The tiny policy's full state dict (its tied head included), norms and MLPs in bf16."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy_path)
    return [(n, t.detach().to(torch.bfloat16) if ("norm" in n or "mlp" in n) else t.detach())
            for n, t in model.state_dict().items()]


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                    b.contiguous().view(torch.uint8))


class RecordedNCCLSync(NCCLWeightSync):
    """The NCCL transport with vLLM's real trainer engine; ``sent`` records what it would broadcast.
    Its init tells the generators what vLLM's trainer_init would (nccl_engine.py), without a group."""

    def __init__(self, generators, **kwargs) -> None:
        super().__init__(generators, **kwargs)
        self.sent: list = []

    def _learner_gpu(self) -> str:
        return LEARNER_GPU

    def _device(self):
        return torch.device("cpu")

    def _open(self, meta):
        from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

        engine = NCCLTrainerWeightTransferEngine(client=self._client, source=self._source,
                                                 packed_buffer_size_bytes=self.bucket_bytes)
        engine._broadcast = lambda source, meta: self.sent.extend(engine._checked_iter(source, meta))
        self._client.init_weight_transfer_engine(worker_init_payload(NCCLWeightTransferInitInfo(
            master_address="recorded", master_port=0, rank_offset=1, world_size=self._world, packed=True,
            packed_buffer_size_bytes=self.bucket_bytes)))
        return engine


def host_ipc_producer(iterator, gpu_uuid, post_iter_func, buffer_size_bytes):
    """``packed_tensor.packed_ipc_producer`` on the CPU: the same chunks (a tensor that would not
    fit starts the next), each chunk's packed bytes sent in place of its CUDA IPC handle."""
    from vllm.distributed.weight_transfer.packed_tensor import PackedIpcChunk

    def chunk(items):
        flat = [post_iter_func(i).contiguous().view(-1).view(torch.uint8) for i in items]
        return PackedIpcChunk(names=[n for n, _ in items], shapes=[list(t.shape) for _, t in items],
                              dtype_names=[str(t.dtype).split(".")[-1] for _, t in items],
                              tensor_sizes=[f.numel() for f in flat], ipc_handle={gpu_uuid: (torch.cat(flat),)})

    items, size = [], 0
    for item in iterator:
        n = post_iter_func(item).numel() * item[1].element_size()
        if n > buffer_size_bytes:
            raise ValueError(f"Tensor '{item[0]}' has size {n} bytes, which exceeds buffer_size_bytes")
        if size and size + n > buffer_size_bytes:
            yield chunk(items)
            items, size = [], 0
        items.append(item)
        size += n
    if size:
        yield chunk(items)


def host_ipc_trainer():
    """vLLM's IPCTrainerWeightTransferEngine without its CUDA device lookups and ipc_collect."""
    from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerWeightTransferEngine

    class HostIPCTrainer(IPCTrainerWeightTransferEngine):
        def __init__(self, *, client, source, is_sender=True, packed=False, packed_buffer_size_bytes=0):
            TrainerWeightTransferEngine.__init__(self, client=client, source=source, is_sender=is_sender)
            self.packed, self.packed_buffer_size_bytes = packed, packed_buffer_size_bytes
            self.device_index, self.gpu_uuid = 0, LEARNER_GPU

        @staticmethod
        def _post_send_sync() -> None:
            pass

    return HostIPCTrainer


class HostIPCSync(IPCWeightSync):
    """The IPC transport on vLLM's IPC trainer engine (``host_ipc_trainer``); the test replaces
    ``ipc_engine.packed_ipc_producer`` by ``host_ipc_producer``."""

    def _learner_gpu(self) -> str:
        return LEARNER_GPU

    def _device(self):
        return torch.device("cpu")

    def _open(self, meta):
        return host_ipc_trainer().trainer_init(self._init_info(meta), client=self._client, source=self._source)


# ------------------------------------------------------------------ the NCCL round over gloo

class GlooBroadcast:
    """The communicator's one call vLLM's packed producer and consumer make, ``broadcast(tensor,
    src=...)``, over the gloo default group of the two test processes."""

    def broadcast(self, tensor, src, stream=None):
        torch.distributed.broadcast(tensor, src=src)

    def destroy(self):
        pass


def host_accelerator() -> None:
    """vLLM's packed broadcast orders its chunks with CUDA streams (``_get_streams``, asked for
    the current accelerator's index) and syncs the device after a receive. Over gloo a broadcast
    has returned once its bytes are there, so streams that are always synchronised stand in."""
    from vllm.distributed.weight_transfer import packed_tensor

    class HostStream:
        def synchronize(self):
            pass

    packed_tensor._get_streams = lambda device_idx, num_buffers: tuple(HostStream() for _ in range(num_buffers))
    torch.accelerator.current_device_index = lambda: 0
    torch.accelerator.synchronize = lambda *a, **k: None


def join_gloo(store_path: str, rank: int) -> None:
    torch.distributed.init_process_group("gloo", store=torch.distributed.FileStore(store_path, 2),
                                         rank=rank, world_size=2)


class GlooNCCLSync(NCCLWeightSync):
    def _learner_gpu(self) -> str:
        return LEARNER_GPU

    def _device(self):
        return torch.device("cpu")


class GlooLearner:
    """Learner rank 0: tether's NCCL transport as a run has it; vLLM's trainer engine opens a
    GlooBroadcast where it would open its NCCL endpoint."""

    def __init__(self, store_path: str) -> None:
        from vllm.distributed.weight_transfer import nccl_engine

        host_accelerator()
        nccl_engine.open_trainer_endpoint = lambda init_info: GlooBroadcast()
        self.store_path = store_path

    def join(self) -> None:
        join_gloo(self.store_path, 0)

    def push(self, generator, version: int, bucket_bytes: int, policy_path: str, streamed: bool):
        """(report, the pairs sent, the state's names): the policy's state pushed to ``generator``."""
        state = policy_state(policy_path)
        meta = [(n, t.dtype, tuple(t.shape)) for n, t in state] if streamed else None
        sync = GlooNCCLSync({"generator-0": generator}, bucket_bytes=bucket_bytes)
        try:
            report = sync.push(version, iter(state), tied_embeddings=True, metadata=meta)
        finally:
            sync.shutdown()
        return report, list(policy_weights(state, tied_embeddings=True)), [n for n, _ in state]


class GlooGenerator:
    """A generator's side of the round: vLLM's worker-side NCCLWeightTransferEngine, its group a
    GlooBroadcast, loading into a recorder instead of a model."""

    def __init__(self, store_path: str) -> None:
        from vllm.distributed.weight_transfer import nccl_engine

        host_accelerator()
        nccl_engine.worker_init_process_group = lambda init_info, parallel_config: GlooBroadcast()
        self.store_path, self._version, self.engine = store_path, 0, None
        self.loaded, self.chunks, self.update_infos = [], 0, []

    def join(self) -> None:
        join_gloo(self.store_path, 1)

    def load_weights(self, weights) -> None:  # the model's, as vLLM's consumer calls it per chunk
        self.chunks += 1
        self.loaded.extend((n, t.clone()) for n, t in weights)

    def version(self) -> int:
        return self._version

    def weight_transfer_gpus(self, transport: str) -> list[str]:
        return ["GPU-generator"]

    def init_weight_transfer(self, init_info: dict) -> None:
        from types import SimpleNamespace

        from vllm.config import WeightTransferConfig
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        self.init_info = init_info
        self.engine = NCCLWeightTransferEngine(WeightTransferConfig(backend="nccl"),
                                               SimpleNamespace(parallel_config=None, model_config=None),
                                               torch.device("cpu"), self)
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def start_weight_update(self, version: int) -> None:
        self.loaded, self.chunks = [], 0

    def update_weights(self, update_info: dict) -> None:
        self.update_infos.append(update_info)
        self.engine.update_weights(update_info)

    def finish_weight_update(self, version: int) -> dict:
        self._version = version
        return {"version": version}

    def shutdown_weight_transfer(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()

    def received(self) -> dict:
        return {"loaded": self.loaded, "chunks": self.chunks, "update_info": self.update_infos[-1],
                "init_info": self.init_info}

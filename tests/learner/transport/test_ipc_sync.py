"""The CUDA IPC weight transport (learner/transport/ipc.py) on the CPU.

The pure parts (vLLM's chunking rule, the buffer size, the same-GPU check) and push rounds
through vLLM's real IPC trainer engine (trainer_init, send_weights, its packed loop and
_do_send) to fake generators, with only its CUDA parts replaced (vllm_rounds.HostIPCSync:
the device lookups, the IPC buffer, ipc_collect). The handle vLLM would send is stood in for
by the chunk's packed bytes, which vLLM's own unpack_tensor turns back into the tensors.
The GPU tier: test_gpu_weight_sync.py.
"""
import pytest
import torch
from vllm_rounds import LEARNER_GPU, HostIPCSync, calls, host_ipc_producer, lm_state

from learner.transport.ipc import check_same_gpu, ipc_buffer_bytes, ipc_packing_plan


@pytest.mark.unit
def test_ipc_packing_plan_fills_the_buffer_without_crossing_it():
    assert ipc_packing_plan([4, 4, 4], 8) == [2, 1]
    assert ipc_packing_plan([8, 1, 7, 2], 8) == [1, 2, 1]
    assert ipc_packing_plan([3, 0, 5, 9], 9) == [3, 1]  # a tensor as large as the buffer fills one
    assert ipc_packing_plan([], 8) == []
    with pytest.raises(ValueError, match="a 9-byte tensor does not fit the 8-byte IPC buffer"):
        ipc_packing_plan([4, 9], 8)
    assert ipc_buffer_bytes([10, 300, 20], 100) == 300 and ipc_buffer_bytes([10], 100) == 100


@pytest.mark.unit
def test_ipc_packing_plan_matches_the_host_producer():
    """host_ipc_producer (the stand-in for vLLM's CUDA producer in the rounds below) cuts where the
    plan does; test_gpu_weight_sync.py compares the plan with vLLM's own producer on a GPU."""
    tensors = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([5, 30, 2, 7, 25, 1, 1])]
    chunks = list(host_ipc_producer(iter(tensors), "GPU-x", lambda item: item[1], 120))
    assert [len(c.names) for c in chunks] == ipc_packing_plan([t.numel() * 4 for _, t in tensors], 120)


@pytest.mark.unit
def test_generators_must_be_on_the_learners_gpu():
    check_same_gpu("GPU-a", {"generator-0": ["GPU-a"], "generator-1": ["GPU-a"]})
    with pytest.raises(ValueError) as err:
        check_same_gpu("GPU-a", {"generator-0": ["GPU-a"], "generator-1": ["GPU-a", "GPU-b"]})
    message = str(err.value)
    assert message.startswith("weight_sync='ipc': generator-1 worker 1 is on GPU GPU-b, not on learner rank 0's GPU")
    assert "num_gpus 0.5" in message and "weight_sync='nccl'" in message and "\n" not in message


@pytest.fixture
def host_producer(monkeypatch):
    from vllm.distributed.weight_transfer import ipc_engine
    monkeypatch.setattr(ipc_engine, "packed_ipc_producer", host_ipc_producer)


def unpacked(update: dict) -> list[tuple[str, torch.Tensor]]:
    """A chunk as vLLM's worker rebuilds it (packed_ipc_consumer's unpack_tensor), from the stand-in bytes."""
    from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

    (packed,) = update["ipc_handles"][LEARNER_GPU]
    return unpack_tensor(packed, update["names"], update["shapes"],
                         [getattr(torch, d) for d in update["dtype_names"]], update["tensor_sizes"])


@pytest.mark.integration
@pytest.mark.parametrize("streamed", [False, True])
def test_push_round_through_vllm_ipc_trainer_engine(fake_generators, host_producer, streamed):
    import ray
    gens = fake_generators(2, gpu=LEARNER_GPU)
    sync = HostIPCSync(gens, bucket_bytes=300)
    named = lm_state()
    meta = [(n, t.dtype, tuple(t.shape)) for n, t in named] if streamed else None
    report = sync.push(4, iter(named), tied_embeddings=True, metadata=meta)

    expected = [(n, t) for n, t in named if n not in ("lm_head.weight", "value_head.weight")]
    sizes = [t.numel() * t.element_size() for _, t in expected]
    plan = ipc_packing_plan(sizes, ipc_buffer_bytes(sizes, 300))  # the 2048-byte embedding sets the buffer
    for g in gens:
        kinds = [c[0] for c in calls(g)]
        assert kinds == ["gpus", "init", "start", *["update"] * len(plan), "finish"]
        assert calls(g)[0][1] == "ipc" and calls(g)[1][1] == {"packed": True}  # no rank offset: no rendezvous
        updates = [c[1] for c in calls(g) if c[0] == "update"]
        assert [len(u["names"]) for u in updates] == plan
        got = [pair for u in updates for pair in unpacked(u)]
        assert [n for n, _ in got] == [n for n, _ in expected]
        assert all(a.dtype == b.dtype and torch.equal(a, b) for (_, a), (_, b) in zip(got, expected))
        assert ray.get(g.version.remote()) == 4
    assert report == {**report, "version": 4, "generators": 2, "bytes": sum(sizes), "transport": "ipc",
                      "buckets": len(plan)}
    assert sync.buffer_bytes == 2048 and report["buckets"] == 2


@pytest.mark.integration
def test_ipc_version_handshake_and_recovery(fake_generators, host_producer):
    g0, g1 = fake_generators(2, gpu=LEARNER_GPU)
    sync = HostIPCSync({"generator-0": g0}, bucket_bytes=1 << 20)
    sync.push(2, iter(lm_state()), tied_embeddings=True)
    engine = sync.engine
    with pytest.raises(ValueError, match="version 1 is older than the loaded version 2"):
        sync.push(1, iter(lm_state()), tied_embeddings=True)
    assert sync.engine is engine and sync.broken is None
    sync.set_generators({"generator-0": g0, "generator-1": g1})  # a new set: a new group on the next push
    assert sync.push(3, iter(lm_state()), tied_embeddings=True)["generators"] == 2
    assert [c[0] for c in calls(g0)].count("init") == 2 and [c[0] for c in calls(g1)].count("init") == 1


@pytest.mark.integration
def test_a_generator_on_another_gpu_is_refused_before_any_round(fake_generators, host_producer):
    sync = HostIPCSync({"generator-0": fake_generators(1, gpu="GPU-other")[0]})
    with pytest.raises(ValueError, match="generator-0 worker 0 is on GPU GPU-other"):
        sync.push(1, iter(lm_state()), tied_embeddings=True)
    assert sync.engine is None

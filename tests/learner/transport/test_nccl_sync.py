"""The NCCL weight transport (learner/transport/nccl.py) on the CPU.

The pure parts (packing plan against vLLM's own packer, rank layout, GPU check, config
errors) and push rounds through vLLM's real trainer-side engine with the NCCL broadcast
recorded (vllm_rounds.RecordedNCCLSync) to fake generators. The broadcast itself, over gloo:
test_packed_broadcast.py; a generator dying mid-round: test_weight_sync_recovery.py; the GPU
tier: test_gpu_weight_sync.py.
"""
import re

import numpy as np
import pytest
import torch
from vllm_rounds import RecordedNCCLSync, calls, lm_state

from learner.config import LearnerConfig
from learner.export import make_weight_sync
from learner.transport.base import CPUWeightSync
from learner.transport.ipc import IPCWeightSync
from learner.transport.nccl import NCCLWeightSync, check_distinct_gpus, packing_plan, rank_layout
from learner.transport.vllm_api import GeneratorClient

# ------------------------------------------------------------------------------ pure


@pytest.mark.unit
@pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")
@pytest.mark.parametrize("bucket", [1, 100, 1000, 4096, 1 << 20])
def test_packing_plan_matches_vllm_packer(bucket):
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    rng = np.random.default_rng(bucket)
    tensors = [(f"t{i}", torch.zeros(int(n), dtype=torch.float32)) for i, n in
               enumerate(rng.integers(0, 600, 40))]
    it, chunks = iter(tensors), []
    while (chunk := pack_tensors(it, lambda item: item[1], bucket)) is not None:
        chunks.append(len(chunk.names))
    assert packing_plan([t.numel() * 4 for _, t in tensors], bucket) == chunks


@pytest.mark.unit
def test_rank_layout_gives_each_engine_its_own_offset():
    assert rank_layout([1]) == ([1], 2)
    assert rank_layout([1, 2, 1]) == ([1, 2, 4], 5)  # tp=2 engine takes ranks 2 and 3
    assert rank_layout([]) == ([], 1)
    with pytest.raises(ValueError, match="0 vLLM workers"):
        rank_layout([1, 0])


@pytest.mark.unit
def test_two_ranks_on_one_gpu_are_refused_up_front():
    check_distinct_gpus("GPU-a", {"generator-0": ["GPU-b"], "generator-1": ["GPU-c", "GPU-d"]})
    with pytest.raises(ValueError) as err:
        check_distinct_gpus("GPU-a", {"generator-0": ["GPU-b"], "generator-1": ["GPU-a"]})
    assert "learner rank 0 and generator-1 worker 0 share GPU GPU-a" in str(err.value)
    assert "weight_sync='ipc'" in str(err.value) and "\n" not in str(err.value)  # the way out with one GPU
    with pytest.raises(ValueError, match="generator-0 worker 1 and generator-1 worker 0"):
        check_distinct_gpus("GPU-a", {"generator-0": ["GPU-b", "GPU-c"], "generator-1": ["GPU-c"]})


@pytest.mark.unit
@pytest.mark.parametrize("transport", ["nccl", "ipc"])
def test_gpu_transport_config(transport):
    assert LearnerConfig().weight_sync == "cpu"
    cfg = LearnerConfig.from_dict({"weight_sync": transport})
    cfg.validate(1)  # the driver may have no GPU: validate does not look for one
    cfg.check_device(has_cuda=True)
    with pytest.raises(ValueError) as err:
        cfg.check_device(has_cuda=False)
    assert re.fullmatch(rf"learner\.weight_sync='{transport}' needs CUDA[^\n]*weight_sync='cpu'[^\n]*", str(err.value))
    LearnerConfig().check_device(has_cuda=False)
    with pytest.raises(ValueError, match=r"learner.weight_sync='gloo' is unknown; use one of cpu, nccl, ipc"):
        LearnerConfig(weight_sync="gloo").validate(1)


@pytest.mark.unit
def test_ipc_needs_a_learner_of_one_rank():
    LearnerConfig(weight_sync="nccl").validate(2)
    with pytest.raises(ValueError, match=r"^learner.weight_sync='ipc' [^\n]*learner.replicas=1 \(got 2\)[^\n]*'nccl'"):
        LearnerConfig(weight_sync="ipc").validate(2)


@pytest.mark.unit
def test_make_weight_sync():
    assert isinstance(make_weight_sync("cpu", []), CPUWeightSync)
    assert isinstance(make_weight_sync("cpu", {"generator-0": None}), CPUWeightSync)
    sync = make_weight_sync("nccl", [], bucket_bytes=1 << 20)  # no group yet: formed on the first push
    assert isinstance(sync, NCCLWeightSync) and sync.bucket_bytes == 1 << 20
    assert isinstance(make_weight_sync("ipc", {}), IPCWeightSync)
    with pytest.raises(ValueError, match="unknown transport 'gloo'; use 'cpu', 'nccl' or 'ipc'"):
        make_weight_sync("gloo", [])


@pytest.mark.unit
def test_generator_weight_sync_values(policy_path):
    from actors.generator import Generator
    with pytest.raises(ValueError, match="generator-0: weight_sync='gloo' is unknown; use 'cpu', 'nccl' or 'ipc'"):
        Generator(model=policy_path, name="generator-0", weight_sync="gloo")


# ------------------------------------------------------------ rounds on the CPU


@pytest.mark.integration
@pytest.mark.parametrize("streamed", [False, True])
def test_push_round_through_vllm_trainer_engine(fake_generators, streamed):
    import ray
    gens = fake_generators(2)
    sync = RecordedNCCLSync(gens, bucket_bytes=300)
    named = lm_state()
    meta = [(n, t.dtype, tuple(t.shape)) for n, t in named] if streamed else None
    report = sync.push(4, iter(named), tied_embeddings=True, metadata=meta)

    expected = [(n, t) for n, t in named if n not in ("lm_head.weight", "value_head.weight")]
    assert [n for n, _ in sync.sent] == [n for n, _ in expected]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(sync.sent, expected))
    for g in gens:  # the group once, then three metadata-only calls per generator, whatever the tensors
        assert [c[0] for c in calls(g)] == ["gpus", "init", "start", "update", "finish"]
        assert calls(g)[0][1] == "nccl"
        update = calls(g)[3][1]
        assert update["names"] == [n for n, _ in expected]
        assert update["dtype_names"] == ["float32", "float32", "bfloat16"]
        assert update["shapes"] == [[64, 8], [8, 8], [8]]
        assert ray.get(g.version.remote()) == 4
    nbytes = 64 * 8 * 4 + 8 * 8 * 4 + 8 * 2
    assert report == {**report, "version": 4, "generators": 2, "bytes": nbytes, "transport": "nccl",
                      "buckets": len(packing_plan([2048, 256, 16], 300))}
    assert report["buckets"] == 2 and report["init_seconds"] > 0


@pytest.mark.integration
def test_version_handshake(fake_generators):
    """A version older than a generator's loaded one is refused before any generator is touched
    (``touched`` stays False) and the group is kept; the same version (the re-push after a
    rollback) and a newer one land and touch them."""
    gens = fake_generators(2)
    sync = RecordedNCCLSync(gens, bucket_bytes=1 << 20)
    sync.push(4, iter(lm_state()), tied_embeddings=True)
    engine = sync.engine
    for older in (3, 0):
        with pytest.raises(ValueError, match=f"version {older} is older than the loaded version 4"):
            sync.push(older, iter(lm_state()), tied_embeddings=True)
        assert sync._client.touched is False and sync.broken is None and sync.engine is engine
    assert all([c[0] for c in calls(g)].count("start") == 1 for g in gens)  # nobody was touched
    assert sync.push(4, iter(lm_state()), tied_embeddings=True)["version"] == 4  # equal: the re-push after a rewind
    assert sync._client.touched is True
    report = sync.push(5, iter(lm_state(1)), tied_embeddings=False)
    assert report["version"] == 5 and report["init_seconds"] == 0.0 and sync.engine is engine  # the group kept
    assert "lm_head.weight" in calls(gens[0])[-2][1]["names"]  # untied: the head is its own tensor
    assert [c[0] for c in calls(gens[0])].count("init") == 1


@pytest.mark.integration
def test_a_failed_round_that_touched_the_generators_tears_the_group_down(fake_generators):
    gens = fake_generators(1)
    sync = RecordedNCCLSync(gens, bucket_bytes=1 << 20)
    named = lm_state()
    wrong = [(n, t.dtype, (1,)) for n, t in named]
    with pytest.raises(ValueError, match="disagrees with iteration"):
        sync.push(1, iter(named), tied_embeddings=True, metadata=wrong)
    assert sync.broken.startswith("ValueError: WeightSource metadata() disagrees") and sync.engine is None
    assert ("shutdown", None) in calls(gens[0])  # the generator gave the round up and left
    report = sync.push(2, iter(named), tied_embeddings=True)  # a new group, then the round
    assert report["version"] == 2 and report["init_seconds"] > 0 and sync.broken is None
    assert [c[0] for c in calls(gens[0])].count("init") == 2


@pytest.mark.integration
def test_client_gives_each_generator_its_rank_offset(fake_generators):
    gens = fake_generators(3)
    client = GeneratorClient(gens, [1, 3, 4])  # generator 1 runs tensor_parallel=2
    client.init_weight_transfer_engine({"master_address": "10.0.0.1", "master_port": 5, "rank_offset": 1,
                                        "world_size": 5, "packed": True})
    assert [calls(g)[0][1]["rank_offset"] for g in gens] == [1, 3, 4]
    assert all(calls(g)[0][1]["world_size"] == 5 for g in gens)


@pytest.mark.integration
@pytest.mark.parametrize("transport", ["nccl", "ipc"])
def test_gpu_transport_on_cpu_fails_with_one_line(policy_path, fake_generators, transport):
    """Both GPU transports fail without CUDA, in one line, in the learner, the generator (before
    any vLLM engine starts) and the transport itself."""
    from actors.generator import Generator
    from learner.transport.ipc import IPCWeightSync
    from learner.worker import LearnerWorker

    sync = {"nccl": NCCLWeightSync, "ipc": IPCWeightSync}[transport]
    with pytest.raises(ValueError, match=rf"^learner.weight_sync='{transport}' needs CUDA on the learner"):
        LearnerWorker(rank=0, world_size=1, model=policy_path, config=LearnerConfig(weight_sync=transport))
    with pytest.raises(ValueError, match=rf"^generator: weight_sync='{transport}' needs CUDA"):
        Generator(model=policy_path, weight_sync=transport)
    with pytest.raises(ValueError, match=rf"^weight_sync='{transport}' needs CUDA on learner rank 0; use "
                                         r"weight_sync='cpu'$"):
        sync(fake_generators(1)).push(1, iter(lm_state()), tied_embeddings=True)


@pytest.mark.integration
def test_a_torn_down_groups_client_sends_nothing(fake_generators):
    """vLLM leaves a failed round's update_weights on a thread of its own; once the group is
    torn down that call must not reach a generator, where it would land in the next round."""
    gens = fake_generators(1)
    client = GeneratorClient(gens)
    client.close()
    with pytest.raises(RuntimeError, match="update_weights after the group was torn down"):
        client.update_weights({"names": []})
    assert calls(gens[0]) == []

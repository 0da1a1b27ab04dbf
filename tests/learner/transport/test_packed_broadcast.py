"""The NCCL transport's round end to end between two processes, over gloo instead of NCCL.

Learner rank 0 (vllm_rounds.GlooLearner) runs tether's NCCLWeightSync as a run does: the
tiny policy's real state (norms and MLPs in bf16, the tied head left out by
learner.transport.base.policy_weights), vLLM's NCCLTrainerWeightTransferEngine.trainer_init and
send_weights, its packed_nccl_broadcast_producer. The generator (vllm_rounds.GlooGenerator)
receives with vLLM's worker-side NCCLWeightTransferEngine: the init info tether sent, the
update info (names, dtype_names, shapes) vLLM built from tether's metadata, and
packed_nccl_broadcast_consumer cutting the same chunks from it. What is replaced: the NCCL
communicator, by an object whose broadcast() is torch.distributed.broadcast on a gloo group
of the two (vllm_rounds.GlooBroadcast), and vLLM's CUDA streams, which on the CPU have
nothing to order (vllm_rounds.host_accelerator).
"""
import itertools

import pytest
from vllm_rounds import GlooGenerator, GlooLearner, bit_equal

from core.infra.weights import WEIGHT_UPDATE_GROUP
from learner.transport.nccl import packing_plan

pytestmark = pytest.mark.integration

VERSIONS = itertools.count(1)


@pytest.fixture(scope="module")
def peers(ray_cluster, tmp_path_factory):
    import ray

    store = str(tmp_path_factory.mktemp("gloo") / "store")  # a file rendezvous: no port to pick
    learner = ray.remote(num_cpus=0)(GlooLearner).remote(store)
    generator = ray.remote(num_cpus=0, concurrency_groups={WEIGHT_UPDATE_GROUP: 1})(GlooGenerator).remote(store)
    ray.get([learner.join.remote(), generator.join.remote()])
    yield learner, generator
    for actor in (learner, generator):
        ray.kill(actor)


@pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")
@pytest.mark.parametrize("bucket, streamed", [(4096, False), (64 << 10, True), (600 << 10, False), (1 << 30, True)])
def test_generator_rebuilds_every_tensor_bit_exactly(peers, policy_path, bucket, streamed):
    """4 KiB: nearly every tensor is larger than a bucket; 1 GiB: the whole model in one chunk."""
    import ray
    learner, generator = peers
    version = next(VERSIONS)
    report, sent, state = ray.get(learner.push.remote(generator, version, bucket, policy_path, streamed))
    got = ray.get(generator.received.remote())

    assert "lm_head.weight" in state and "lm_head.weight" not in [n for n, _ in sent]  # tied: the embedding travels
    assert {str(t.dtype) for _, t in sent} == {"torch.float32", "torch.bfloat16"}
    assert [n for n, _ in got["loaded"]] == [n for n, _ in sent]
    mismatched = [n for (n, a), (_, b) in zip(got["loaded"], sent) if not bit_equal(a, b)]
    assert mismatched == []
    info = got["update_info"]
    assert info["names"] == [n for n, _ in sent]
    assert info["dtype_names"] == [str(t.dtype).split(".")[-1] for _, t in sent]
    assert info["shapes"] == [list(t.shape) for _, t in sent]
    assert got["init_info"]["rank_offset"] == 1 and got["init_info"]["world_size"] == 2
    assert got["init_info"]["packed_buffer_size_bytes"] == bucket
    sizes = [t.numel() * t.element_size() for _, t in sent]
    assert got["chunks"] == report["buckets"] == len(packing_plan(sizes, bucket))
    assert report["version"] == version == ray.get(generator.version.remote())
    assert report["bytes"] == sum(sizes) and report["transport"] == "nccl"

"""The NCCL weight transport (learner/nccl_sync.py).

CPU tier: the pure parts (packing plan against vLLM's own packer, rank layout, GPU
check, config errors) and one push round through vLLM's real trainer-side engine with
the NCCL broadcast replaced by a recorder. GPU tier: learner and vLLM generator as Ray
actors on two GPUs (NCCL refuses two ranks of one group on one GPU), logprobs compared.
"""
import dataclasses
import re

import numpy as np
import pytest
import torch
from helpers import make_rollouts, sgd_config

from learner.config import LearnerConfig
from learner.export import make_weight_sync
from learner.nccl_sync import (
    GeneratorClient,
    NCCLWeightSync,
    _round_source,
    check_distinct_gpus,
    packing_plan,
    rank_layout,
)
from learner.weight_sync import CPUWeightSync

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
    check_distinct_gpus("GPU-a", [["GPU-b"], ["GPU-c", "GPU-d"]])
    with pytest.raises(ValueError, match="learner rank 0 and generator 1 worker 0 share GPU GPU-a"):
        check_distinct_gpus("GPU-a", [["GPU-b"], ["GPU-a"]])
    with pytest.raises(ValueError, match="generator 0 worker 1 and generator 1 worker 0"):
        check_distinct_gpus("GPU-a", [["GPU-b", "GPU-c"], ["GPU-c"]])


@pytest.mark.unit
def test_weight_sync_config():
    assert LearnerConfig().weight_sync == "cpu"
    cfg = LearnerConfig.from_dict({"weight_sync": "nccl"})
    cfg.validate(1)  # the driver may have no GPU: validate does not look for one
    cfg.check_device(has_cuda=True)
    with pytest.raises(ValueError) as err:
        cfg.check_device(has_cuda=False)
    assert re.fullmatch(r"learner\.weight_sync='nccl' needs CUDA[^\n]*weight_sync='cpu'[^\n]*", str(err.value))
    LearnerConfig().check_device(has_cuda=False)
    with pytest.raises(ValueError, match=r"learner.weight_sync='gloo' is unknown; use one of cpu, nccl"):
        LearnerConfig(weight_sync="gloo").validate(1)


@pytest.mark.unit
def test_make_weight_sync():
    assert isinstance(make_weight_sync("cpu", []), CPUWeightSync)
    sync = make_weight_sync("nccl", [], bucket_bytes=1 << 20)  # no group yet: formed on the first push
    assert isinstance(sync, NCCLWeightSync) and sync.bucket_bytes == 1 << 20
    with pytest.raises(ValueError, match="unknown transport 'ipc'"):
        make_weight_sync("ipc", [])


@pytest.mark.unit
def test_generator_weight_sync_values(policy_path):
    from actors.generator import Generator
    with pytest.raises(ValueError, match="generator-0: weight_sync='gloo' is unknown"):
        Generator(model=policy_path, name="generator-0", weight_sync="gloo")


# ------------------------------------------------------------ one round on the CPU


@pytest.fixture(scope="module")
def fake_generators(ray_cluster):
    """make(n): n Ray actors playing the Generator's side of the protocol, recording what
    reaches them (defined here so Ray ships the class by value: tests are not importable there)."""
    import ray

    from core.weights import WEIGHT_UPDATE_GROUP

    @ray.remote(num_cpus=0, concurrency_groups={WEIGHT_UPDATE_GROUP: 1})  # as actors.generator.actor_class
    class FakeGenerator:
        def __init__(self):
            self.calls, self._version = [], 0

        def version(self):
            return self._version

        def init_weight_transfer(self, init_info):
            self.calls.append(("init", init_info))

        def start_weight_update(self, version):
            self.calls.append(("start", version))

        def update_weights(self, update_info):
            self.calls.append(("update", update_info))

        def finish_weight_update(self, version):
            self._version = version
            self.calls.append(("finish", version))
            return {"version": version}

        def calls_(self):
            return self.calls

    return lambda n: [FakeGenerator.remote() for _ in range(n)]


def calls(generator) -> list:
    import ray
    return ray.get(generator.calls_.remote())


def cpu_sync(generators, bucket_bytes):
    """An NCCLWeightSync wired to vLLM's real trainer engine, with the broadcast recorded instead."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    sync = NCCLWeightSync(generators, bucket_bytes=bucket_bytes)
    sync._client = GeneratorClient(generators, rank_layout([1] * len(generators))[0])
    sync._source = _round_source(device="cpu")
    sync._engine = NCCLTrainerWeightTransferEngine(client=sync._client, source=sync._source,
                                                  packed_buffer_size_bytes=bucket_bytes)
    sent = []
    sync._engine._broadcast = lambda source, meta: sent.extend(sync._engine._checked_iter(source, meta))
    return sync, sent


def lm_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(64, 8, generator=g)
    return [("model.embed_tokens.weight", emb), ("model.layers.0.mlp.weight", torch.randn(8, 8, generator=g)),
            ("model.norm.weight", torch.randn(8, generator=g).to(torch.bfloat16)),
            ("lm_head.weight", emb), ("value_head.weight", torch.randn(1, 8, generator=g))]


@pytest.mark.integration
@pytest.mark.parametrize("streamed", [False, True])
def test_push_round_through_vllm_trainer_engine(fake_generators, streamed):
    import ray
    gens = fake_generators(2)
    sync, sent = cpu_sync(gens, bucket_bytes=300)
    named = lm_state()
    meta = [(n, t.dtype, tuple(t.shape)) for n, t in named] if streamed else None
    report = sync.push(4, iter(named), tied_embeddings=True, metadata=meta)

    expected = [(n, t) for n, t in named if n not in ("lm_head.weight", "value_head.weight")]
    assert [n for n, _ in sent] == [n for n, _ in expected]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(sent, expected))
    for g in gens:  # three metadata-only calls per generator, whatever the number of tensors
        assert [c[0] for c in calls(g)] == ["start", "update", "finish"]
        update = calls(g)[1][1]
        assert update["names"] == [n for n, _ in expected]
        assert update["dtype_names"] == ["float32", "float32", "bfloat16"]
        assert update["shapes"] == [[64, 8], [8, 8], [8]]
        assert ray.get(g.version.remote()) == 4
    nbytes = 64 * 8 * 4 + 8 * 8 * 4 + 8 * 2
    assert report == {**report, "version": 4, "generators": 2, "bytes": nbytes, "transport": "nccl",
                      "buckets": len(packing_plan([2048, 256, 16], 300))}
    assert report["buckets"] == 2

    # An older version is refused before any generator is touched; the group stays usable.
    with pytest.raises(ValueError, match="version 3 is older than the loaded version 4"):
        sync.push(3, iter(lm_state()), tied_embeddings=True, metadata=meta)
    assert all(len(calls(g)) == 3 for g in gens) and not sync._broken
    assert sync.push(5, iter(lm_state(1)), tied_embeddings=False)["version"] == 5
    assert "lm_head.weight" in calls(gens[0])[-2][1]["names"]  # untied: the head is its own tensor


@pytest.mark.integration
def test_metadata_that_disagrees_with_the_tensors_breaks_the_group(fake_generators):
    gens = fake_generators(1)
    sync, _ = cpu_sync(gens, bucket_bytes=1 << 20)
    named = lm_state()
    wrong = [(n, t.dtype, (1,)) for n, t in named]
    with pytest.raises(ValueError, match="disagrees with iteration"):
        sync.push(1, iter(named), tied_embeddings=True, metadata=wrong)
    with pytest.raises(RuntimeError, match="unusable after an earlier failure"):
        sync.push(2, iter(named), tied_embeddings=True)


@pytest.mark.integration
def test_client_gives_each_generator_its_rank_offset(fake_generators):
    gens = fake_generators(3)
    client = GeneratorClient(gens, [1, 3, 4])  # generator 1 runs tensor_parallel=2
    client.init_weight_transfer_engine({"master_address": "10.0.0.1", "master_port": 5, "rank_offset": 1,
                                        "world_size": 5, "packed": True})
    assert [calls(g)[0][1]["rank_offset"] for g in gens] == [1, 3, 4]
    assert all(calls(g)[0][1]["world_size"] == 5 for g in gens)


@pytest.mark.integration
def test_nccl_on_cpu_fails_with_one_line(policy_path, fake_generators):
    from actors.generator import Generator
    from learner.worker import LearnerWorker

    with pytest.raises(ValueError, match=r"^learner.weight_sync='nccl' needs CUDA"):
        LearnerWorker(rank=0, world_size=1, model=policy_path, config=LearnerConfig(weight_sync="nccl"))
    with pytest.raises(ValueError, match=r"generator: weight_sync='nccl' needs CUDA"):
        Generator(model=policy_path, weight_sync="nccl")  # before any vLLM engine starts
    with pytest.raises(ValueError, match="needs CUDA on learner rank 0"):
        NCCLWeightSync(fake_generators(1)).push(1, iter(lm_state()), tied_embeddings=True)


# ------------------------------------------------------------------------- GPU tier

GAP_TOL = 1e-3  # fp32 on both sides


@pytest.fixture(scope="module")
def gpu_actors(ray_cluster, policy_path):
    """Learner rank 0 (world of 1) and one vLLM generator as Ray actors on separate GPUs."""
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL refuses two ranks of one communicator on one GPU ('Duplicate GPU "
                    "detected'): the learner and the generator need a GPU each")
    import ray

    from actors.generator import actor_class
    from learner.worker import LearnerWorker

    made = []

    def learner(stage):
        while made:  # one learner at a time: each takes a whole GPU
            ray.kill(made.pop())
        cfg = dataclasses.replace(sgd_config(zero_stage=stage, lr=1.0), weight_sync="nccl")
        actor = ray.remote(LearnerWorker).options(
            num_gpus=1, num_cpus=1, runtime_env={"env_vars": {"DS_ACCELERATOR": "cuda"}}).remote(
            rank=0, world_size=1, model=policy_path, config=cfg)
        made.append(actor)
        return actor

    generator = actor_class().options(num_gpus=1, num_cpus=1).remote(
        model=policy_path, sampling={"temperature": 1.0, "max_new_tokens": 12, "n": 2, "seed": 1},
        engine={"max_model_len": 128, "dtype": "float32", "gpu_memory_utilization": 0.3},
        weight_sync="nccl")
    yield learner, {"generator-0": generator}
    for actor in made + [generator]:
        ray.kill(actor)


@pytest.mark.integration
@pytest.mark.gpu
@pytest.mark.parametrize("stage", [2, 3])
def test_nccl_push_matches_learner_logprobs(gpu_actors, policy_path, stage):
    import ray
    from transformers import AutoTokenizer

    make_learner, generators = gpu_actors
    generator = generators["generator-0"]
    tok = AutoTokenizer.from_pretrained(policy_path)
    prompts = [np.asarray(tok(t)["input_ids"]) for t in ("The cat was", "A dog seemed happy", "My friend felt")]
    learner = make_learner(stage)
    ray.get(learner.train.remote(make_rollouts(policy_path, 8, seed=10 + stage)))

    def gap():
        rollouts = ray.get(generator.generate.remote(prompts)).rollouts
        learner_lp = ray.get(learner.policy_logprobs.remote(rollouts))
        return max(float(np.abs(a - r.behaviour_logprobs).max()) for a, r in zip(learner_lp, rollouts)), rollouts

    stale_gap, _ = gap()
    version = ray.get(generator.version.remote()) + 1
    report = ray.get(learner.push_weights.remote(generators, version=version))
    fresh_gap, fresh = gap()
    print(f"ZeRO-{stage} nccl: group up in {report['init_seconds']:.2f}s, "
          f"push {report['seconds'] * 1e3:.0f} ms, "
          f"{report['bytes'] / 1e6:.2f} MB in {report['buckets']} bucket(s); gap {stale_gap:.2e} -> {fresh_gap:.2e}")
    assert stale_gap > 1e-2, "the update must change the policy for this test to mean anything"
    assert fresh_gap < GAP_TOL
    assert report["version"] == version and ray.get(generator.version.remote()) == version
    assert all(r.policy_version == version for r in fresh)
    assert report["generators"] == 1 and report["bytes"] > 0 and report["buckets"] >= 1

    # The group is kept: an older version is refused without breaking it, a newer one lands.
    with pytest.raises(ValueError, match="older than the loaded version"):
        ray.get(learner.push_weights.remote(generators, version=version - 1))
    ray.get(learner.train.remote(make_rollouts(policy_path, 8, seed=30 + stage)))
    again = ray.get(learner.push_weights.remote(generators, version=version + 1))
    assert again["init_seconds"] == 0.0 and gap()[0] < GAP_TOL
    ray.get(learner.shutdown_weight_sync.remote())  # the next parametrisation forms a new group

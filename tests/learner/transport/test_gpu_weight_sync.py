"""GPU tier of the weight transports: learner rank 0 and a vLLM generator as Ray actors, the
generator's log-probs compared with the learner's after a push, per transport:

* 'nccl': the learner and the generator on a GPU each (NCCL refuses two ranks of one
  communicator on one GPU), so it needs two and skips, saying so, with fewer;
* 'ipc': both on ONE GPU, placed in one placement-group bundle holding it, num_gpus 0.5 each.

On a one-GPU machine the ipc variants run and the nccl ones skip; with two or more, both run.
`scripts/gpu-check.sh` runs this tier. The CPU suite covers what runs without a GPU
(test_nccl_sync.py, test_ipc_sync.py, test_packed_broadcast.py, test_weight_sync_recovery.py).
"""
import dataclasses

import numpy as np
import pytest
import torch
from helpers import make_rollouts, sgd_config

from learner.transport.ipc import ipc_packing_plan

GAP_TOL = 1e-3  # fp32 on both sides
GENERATOR = dict(sampling={"temperature": 1.0, "max_new_tokens": 12, "n": 2, "seed": 1},
                 engine={"max_model_len": 128, "dtype": "float32", "gpu_memory_utilization": 0.3})


def placements(transport: str):
    """(learner options, generator options, placement group or None) for ``transport``."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    gpus = torch.cuda.device_count()
    if transport == "nccl":
        if gpus < 2:
            pytest.skip(f"nccl needs 2 GPUs (NCCL refuses two ranks of one communicator on one GPU); this machine "
                        f"has {gpus}: the ipc variant covers one GPU")
        return {"num_gpus": 1}, {"num_gpus": 1}, None
    pg = placement_group([{"GPU": 1, "CPU": 2}])  # one bundle: one physical GPU for both
    ray.get(pg.ready(), timeout=120)
    shared = {"num_gpus": 0.5, "scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=0)}
    return shared, shared, pg


@pytest.fixture(scope="module", params=["nccl", "ipc"])
def gpu_actors(request, ray_cluster, policy_path):
    """(transport, make_learner(stage), {"generator-0": handle}); one learner at a time."""
    import ray

    from actors.generator import actor_class
    from learner.worker import LearnerWorker

    transport = request.param
    learner_opts, generator_opts, pg = placements(transport)
    made = []

    def learner(stage):
        while made:  # one learner at a time: each takes its share of a GPU
            ray.kill(made.pop())
        cfg = dataclasses.replace(sgd_config(zero_stage=stage, lr=1.0), weight_sync=transport)
        actor = ray.remote(LearnerWorker).options(
            num_cpus=1, runtime_env={"env_vars": {"DS_ACCELERATOR": "cuda"}}, **learner_opts).remote(
            rank=0, world_size=1, model=policy_path, config=cfg)
        made.append(actor)
        return actor

    generator = actor_class().options(num_cpus=1, **generator_opts).remote(
        model=policy_path, weight_sync=transport, **GENERATOR)
    yield transport, learner, {"generator-0": generator}
    for actor in made + [generator]:
        ray.kill(actor)
    if pg is not None:
        ray.util.remove_placement_group(pg)


@pytest.mark.integration
@pytest.mark.gpu
@pytest.mark.parametrize("stage", [2, 3])
def test_push_matches_learner_logprobs(gpu_actors, policy_path, stage):
    import ray
    from transformers import AutoTokenizer

    transport, make_learner, generators = gpu_actors
    generator = generators["generator-0"]
    tok = AutoTokenizer.from_pretrained(policy_path)
    prompts = [np.asarray(tok(t)["input_ids"]) for t in ("The cat was", "A dog seemed happy", "My friend felt")]
    learner = make_learner(stage)
    ray.get(learner.train.remote(make_rollouts(policy_path, 8, seed=10 + stage)))

    def gap():
        rollouts = ray.get(generator.generate.remote(prompts)).rollouts
        learner_lp = ray.get(learner.evaluate.remote(rollouts))
        return max(float(np.abs(a - r.behaviour_logprobs).max()) for a, r in zip(learner_lp, rollouts)), rollouts

    stale_gap, _ = gap()
    version = ray.get(generator.version.remote()) + 1
    report = ray.get(learner.push_weights.remote(generators, version=version))
    fresh_gap, fresh = gap()
    print(f"ZeRO-{stage} {transport}: group up in {report['init_seconds']:.2f}s, "
          f"push {report['seconds'] * 1e3:.0f} ms, "
          f"{report['bytes'] / 1e6:.2f} MB in {report['buckets']} bucket(s); gap {stale_gap:.2e} -> {fresh_gap:.2e}")
    assert stale_gap > 1e-2, "the update must change the policy for this test to mean anything"
    assert fresh_gap < GAP_TOL
    assert report["transport"] == transport
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


@pytest.mark.unit
@pytest.mark.gpu
@pytest.mark.parametrize("buffer", [64, 1000, 4096])
def test_ipc_packing_plan_matches_vllm_ipc_producer(buffer):
    from vllm.distributed.weight_transfer.packed_tensor import packed_ipc_producer

    rng = np.random.default_rng(buffer)
    tensors = [(f"t{i}", torch.zeros(int(n), dtype=torch.float32, device="cuda"))
               for i, n in enumerate(rng.integers(0, buffer // 4 + 1, 40))]
    chunks = [len(c.names) for c in packed_ipc_producer(iter(tensors), "GPU-x", lambda item: item[1], buffer)]
    assert ipc_packing_plan([t.numel() * 4 for _, t in tensors], buffer) == chunks

"""LoRA on two learner ranks (Ray actors, ZeRO-2 and ZeRO-3): the adapter trains as on one rank,
only the adapter and the value head move, and a push sends the gathered adapter to every generator
(recording actors standing in for the generators' side of the contract, checked with the proof)."""
import pytest
import torch
from helpers import make_rollouts, max_abs_diff

from core.infra.weights import adapter_checksum
from core.rollout import shard_rollouts
from learner.config import LearnerConfig, LoraConfig, OptimConfig, PPOConfig
from learner.group import LearnerGroup
from learner.worker import LearnerWorker

pytestmark = pytest.mark.integration


def sgd_lora(stage: int) -> LearnerConfig:
    return LearnerConfig(zero_stage=stage, optim=OptimConfig(optimizer="sgd", lr=0.5, grad_clip=0.0),
                         lora=LoraConfig(rank=8, init="gaussian"),
                         ppo=PPOConfig(ppo_epochs=2, minibatch_size=4, micro_batch_size=2, shuffle=False))


# ZeRO-3 in the slow tier; the default tier: tests/learner/test_lora_push.py::test_adapter_push_lands_and_is_proven
# gathers the ZeRO-3 adapter on one rank.
@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_two_ranks_train_the_adapter_as_one_does_and_push_it(ray_cluster, policy_path, stage):
    import ray

    from core.infra.weights import WEIGHT_UPDATE_GROUP

    @ray.remote(num_cpus=0, concurrency_groups={WEIGHT_UPDATE_GROUP: 1})  # as actors.generator.actor_class
    class RecordingGenerator:  # an engine that binds every module it is sent (its report says so)
        def load_adapter(self, version, files):
            from safetensors.torch import load
            self.tensors = load(files["adapter_model.safetensors"])
            modules = {n.split(".lora_")[0] for n in self.tensors}
            return {"version": version, "checksum": adapter_checksum(files), "bound": len(modules),
                    "unbound": [], "stale": []}

        def tensors_(self):
            return self.tensors

    rollouts = make_rollouts(policy_path, 8, seed=4)
    torch.manual_seed(0)
    one = LearnerWorker(rank=0, world_size=1, model=policy_path, config=sgd_lora(stage))
    before = one.full_state_dict()
    one.train(rollouts)
    expected = one.full_state_dict()
    group = LearnerGroup(model=policy_path, config=sgd_lora(stage), world_size=2, num_cpus_per_rank=1,
                         name_prefix=f"lora-z{stage}")
    try:
        group.train(shard_rollouts(rollouts, 2))
        got = group.state_dict()
        # Two ranks sum the gradient in another order (and with other thread counts) than one: fp32
        # rounding, ~1e-5 here, against an update of ~1 (the bound: 1e-4 of it).
        diff, update = max_abs_diff(got, expected), max_abs_diff(expected, before)
        print(f"ZeRO-{stage} LoRA: two ranks vs one {diff:.1e}; the update {update:.1e}")
        assert diff < 1e-4 * update
        moved = {k for k in expected if not torch.equal(expected[k], before[k])}
        assert moved and all(".lora_" in k or k.startswith("value_head.") for k in moved)
        recorders = [RecordingGenerator.remote() for _ in range(2)]
        report = group.push_weights({"generator-0": recorders[0], "generator-1": recorders[1]}, version=3)
        assert report["version"] == 3 and report["generators"] == 2 and report["adapter_modules"] == 28
        adapter = {k.replace(".default.", ".").replace("lm.", "base_model.model.", 1): v
                   for k, v in got.items() if ".lora_" in k}
        for tensors in ray.get([r.tensors_.remote() for r in recorders]):
            assert max_abs_diff(tensors, adapter) == 0.0
    finally:
        group.shutdown()

"""learner.lora.critic: a separate critic's body trains as a LoRA adapter of its own on its frozen
base (the value head whole). What trains, what a step moves, the merged export and the PEFT adapter
beside it, the refused settings, and a resume that restores the critic's adapter to the bit."""
import json
from pathlib import Path

import pytest
import torch

from learner import lora as adapters
from learner.config import LearnerConfig, LoraConfig, OptimConfig, PPOConfig
from learner.policy import PolicyWithValueHead

IDS = torch.tensor([[5, 17, 301, 44, 9, 88, 120]])
MASK, POS = torch.ones_like(IDS), torch.arange(IDS.shape[1])[None]


def adapted_critic(policy_path, reward_path) -> PolicyWithValueHead:
    torch.manual_seed(0)
    return PolicyWithValueHead.from_pretrained(policy_path, critic="separate", critic_model=reward_path,
                                               lora=LoraConfig(rank=8, critic=True))


def critic_hidden(body, ids=IDS):
    return body(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state


@pytest.mark.unit
def test_a_value_step_moves_the_critic_adapter_alone(policy_path, reward_path):
    model = adapted_critic(policy_path, reward_path)
    trains = [n for n, p in model.named_parameters() if p.requires_grad]
    assert [n for n in trains if not adapters.is_adapter_param(n)] == ["value_head.weight", "value_head.bias"]
    assert {n.split(".")[0] for n in trains if adapters.is_adapter_param(n)} == {"lm", "critic_body"}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    _, values = model(IDS, MASK, POS)
    ((values - 1.0) ** 2).mean().backward()
    optimizer.step()
    after = dict(model.named_parameters())
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert moved and all(n.startswith("value_head.") or n.startswith("critic_body.") and ".lora_" in n
                         for n in moved), sorted(moved)  # the critic's base (and the LM) unchanged
    assert any(n.startswith("critic_body.") for n in moved)


@pytest.mark.unit
def test_the_export_holds_the_merged_critic_and_its_peft_adapter(policy_path, reward_path, tmp_path):
    from peft import PeftModel
    from transformers import AutoModel

    model = adapted_critic(policy_path, reward_path)
    with torch.no_grad():
        for name, p in model.critic_body.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.1)
        want = critic_hidden(model.critic_body)
        with adapters.adapter_disabled(model.critic_body):
            assert (want - critic_hidden(model.critic_body)).abs().max() > 1e-3  # the adapter matters
        values = model(IDS, MASK, POS)[1]
        out = model.save_pretrained(tmp_path / "export")
        merged = AutoModel.from_pretrained(out / "critic", dtype=torch.float32)
        config = json.loads((out / "critic" / "adapter" / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == reward_path and config["task_type"] == "FEATURE_EXTRACTION"
        peft = PeftModel.from_pretrained(AutoModel.from_pretrained(reward_path, dtype=torch.float32),
                                         out / "critic" / "adapter")
        assert (want - critic_hidden(merged)).abs().max() < 1e-5  # merged in fp32 = base + adapter
        assert (want - critic_hidden(peft)).abs().max() < 1e-5
        again = PolicyWithValueHead.from_pretrained(out, critic="separate")  # reads critic/
        assert (again(IDS, MASK, POS)[1] - values).abs().max() < 1e-5


@pytest.mark.unit
def test_a_resumable_checkpoint_keeps_the_critic_adapter_only(policy_path, reward_path, tmp_path):
    model = adapted_critic(policy_path, reward_path)
    trainable = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}  # what a checkpoint gathers
    out = model.save_pretrained(tmp_path / "policy", state_dict=trainable, with_lm=False)
    assert sorted(p.name for p in (out / "critic").iterdir()) == ["adapter"]  # no frozen base copied
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    from safetensors.torch import load_file
    saved = load_file(out / "critic" / "adapter" / "adapter_model.safetensors")
    assert len(saved) == sum(n.startswith("critic_body.") for n in trainable) > 0


@pytest.mark.unit
@pytest.mark.parametrize("settings, message", [
    ({"lora": {"critic": True}, "critic": "separate", "critic_model": "/rm"},
     "learner.lora.critic=true trains the critic as an adapter .* needs learner.lora.rank > 0"),
    ({"lora": {"rank": 8, "critic": True}}, "learner.critic=null has none; set learner.critic=separate"),
    ({"lora": {"rank": 8, "critic": True}, "critic": "shared"}, "learner.critic=shared has none"),
])
def test_an_adapter_on_the_critic_needs_one_on_the_policy_and_a_separate_critic(settings, message):
    with pytest.raises(ValueError, match=message):
        LearnerConfig.from_dict(settings)
    LearnerConfig.from_dict({"lora": {"rank": 8, "critic": True}, "critic": "separate", "critic_model": "/rm"})


@pytest.mark.unit
def test_the_job_refuses_it_and_a_resume_that_changes_it(tmp_path):
    from cluster.config.ppo import load_config
    from cluster.runtime.state.checkpoint import CheckpointError, RunState, check_compatible, pinned_values
    from core.infra.errors import UserError

    with pytest.raises(UserError, match="config: learner.lora.critic=true .* learner.critic=shared has none"):
        load_config("configs/tiny-cpu.yaml", ["learner.lora.rank=8", "learner.lora.critic=true",
                                              "learner.critic=shared"])
    separate = ["learner.lora.rank=8", "learner.critic=separate", "learner.critic_model=/rm"]
    saved = load_config("configs/tiny-cpu.yaml", separate)
    state = RunState(step=2, version=2, batches_issued=2, unfinished=(), kl_beta=0.05,
                     pinned=json.loads(json.dumps(pinned_values(saved))))
    now = load_config("configs/tiny-cpu.yaml", [*separate, "learner.lora.critic=true"])
    with pytest.raises(CheckpointError, match="learner.lora.critic=True differs from the checkpoint's False"):
        check_compatible(state, now, Path(tmp_path))


@pytest.mark.unit
def test_the_critics_targets_are_checked_before_any_actor_starts(policy_path, reward_path):
    from transformers import AutoConfig

    from cluster.config.ppo import load_config
    from cluster.runtime.prepare import check_adapter_targets
    from core.infra.errors import UserError

    cfg = load_config("configs/tiny-cpu.yaml", ["learner.lora.rank=8", "learner.lora.critic=true",
                                                "learner.critic=separate", f"learner.critic_model={reward_path}"])
    check_adapter_targets(cfg.learner, AutoConfig.from_pretrained(policy_path))
    quantized = AutoConfig.from_pretrained(policy_path)
    quantized.quantization_config = {"quant_method": "gptq", "bits": 4}
    with pytest.raises(UserError, match=r"learner.critic_model is quantized \(gptq\)"):
        from transformers import AutoModel
        adapters.check_targets(quantized, LoraConfig(rank=8), key="learner.critic_model", auto_class=AutoModel)
    with pytest.raises(UserError, match="learner.critic_model='/no/rm' does not exist; point it at a sequence-"):
        missing = load_config("configs/tiny-cpu.yaml", ["learner.lora.rank=8", "learner.lora.critic=true",
                                                        "learner.critic=separate", "learner.critic_model=/no/rm"])
        check_adapter_targets(missing.learner, AutoConfig.from_pretrained(policy_path))


@pytest.mark.integration
def test_a_resume_restores_the_critic_adapter_exactly(policy_path, reward_path, tmp_path):
    from helpers import make_rollouts, max_abs_diff

    from learner.worker import LearnerWorker

    cfg = LearnerConfig(critic="separate", critic_model=reward_path, lora=LoraConfig(rank=8, critic=True),
                        optim=OptimConfig(lr=1e-2, warmup_steps=1, total_steps=10),
                        ppo=PPOConfig(ppo_epochs=1, minibatch_size=2, micro_batch_size=2))
    rollouts = make_rollouts(policy_path, 2, seed=1)
    a = LearnerWorker(rank=0, world_size=1, model=policy_path, config=cfg)
    health = a.health()
    lm_adapter = sum(p.numel() for n, p in a.engine.module.lm.named_parameters() if adapters.is_adapter_param(n))
    assert health["lora_critic"] and health["trainable_parameters"] == 2 * lm_adapter + 129  # both adapters, head
    a.train(rollouts)
    a.save(tmp_path / "ckpt")
    saved = a.full_state_dict()
    [states] = (tmp_path / "ckpt").glob("deepspeed/*/mp_rank_00_model_states.pt")
    kept = torch.load(states, weights_only=False)["module"]
    # only what trains: not the frozen bases, nor the tied output head under its second name
    assert kept and [k for k in kept if ".lora_" not in k and not k.startswith("value_head.")] == []
    a.train(rollouts)
    b = LearnerWorker(rank=0, world_size=1, model=policy_path, config=cfg)
    assert max_abs_diff(b.full_state_dict(), saved) > 1e-4  # built afresh: the load has something to restore
    assert b.load(tmp_path / "ckpt") == 1
    assert max_abs_diff(b.full_state_dict(), saved) == 0.0  # the critic's adapter came back to the bit
    b.train(rollouts)
    want, got = a.full_state_dict(), b.full_state_dict()
    assert max_abs_diff(want, got) == 0.0  # and its optimizer state: the resumed step is the same step
    critic_moved = {k for k in want if k.startswith("critic_body.") and not torch.equal(want[k], saved[k])}
    assert critic_moved and all(".lora_" in k for k in critic_moved)


@pytest.mark.unit
def test_the_start_up_line_says_both_adapters_train():
    from types import SimpleNamespace

    from cluster.runtime.pools.launch import learner_line

    health = {"trainable_parameters": 155_777, "parameters": 1_995_137, "lora_rank": 8, "lora_critic": True}
    pools = SimpleNamespace(learner=SimpleNamespace(health=lambda: [health]))  # the LearnerGroup's health() rows
    assert learner_line(pools) == ("learner: trains a LoRA adapter of rank 8 on the policy and one on the critic: "
                                   "155,777 of 1,995,137 parameters (7.81%)")
    health["lora_critic"] = False
    assert learner_line(pools).startswith("learner: trains a LoRA adapter of rank 8: 155,777 of")

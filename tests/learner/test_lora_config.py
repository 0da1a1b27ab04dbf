"""learner.lora's bad input: one line each, naming the key and the fix, before any actor starts."""
import dataclasses
import json
from pathlib import Path

import pytest

from core.infra.errors import UserError
from learner import lora as adapters
from learner.config import LearnerConfig, LoraConfig

pytestmark = pytest.mark.unit  # loads the tiny model: no process, no Ray


@pytest.mark.parametrize("settings, message", [
    ({"rank": -1}, "learner.lora.rank=-1 must be in [0, 512]"),
    ({"rank": 1024}, "vLLM serves ranks up to 512"),
    ({"rank": 8, "alpha": 0}, "learner.lora.alpha=0"),
    ({"rank": 8, "dropout": 1.0}, "learner.lora.dropout=1.0 must be in [0, 1)"),
    ({"rank": 8, "target_modules": []}, "must name modules"),
    ({"rank": 8, "init": "pissa"}, "learner.lora.init='pissa' is unknown; use one of default, gaussian"),
])
def test_bad_settings_name_the_key(settings, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        LoraConfig(**settings).validate()


def test_ppo_refuses_adapter_dropout():
    with pytest.raises(ValueError, match="learner.lora.dropout=0.1: PPO's ratios .* set learner.lora.dropout=0"):
        LearnerConfig.from_dict({"lora": {"rank": 8, "dropout": 0.1}})


def test_engine_rank_follows_the_adapter_or_refuses_a_smaller_engine():
    assert LoraConfig().engine_rank() == 0  # no adapter: the engines start without LoRA
    assert LoraConfig(rank=8).engine_rank() == 8
    assert LoraConfig(rank=12).engine_rank() == 16  # the next rank vLLM serves
    assert LoraConfig(rank=8).engine_rank(served=32) == 32
    with pytest.raises(ValueError, match="learner.lora.rank=16 is above generator.engine.max_lora_rank=8.*raise "
                                         "max_lora_rank to 16 or set it to 0"):
        LoraConfig(rank=16).engine_rank(served=8)


def test_the_job_config_refuses_an_engine_rank_below_the_adapter():
    from cluster.config.ppo import load_config
    from core.infra.errors import UserError as Refused

    with pytest.raises(Refused, match="config: learner.lora.rank=16 is above generator.engine.max_lora_rank=8"):
        load_config("configs/tiny-cpu.yaml", ["learner.lora.rank=16", "generator.engine.max_lora_rank=8"])
    with pytest.raises(Refused, match="generator.engine.max_lora_rank=12 is not a rank vLLM serves"):
        load_config("configs/tiny-cpu.yaml", ["generator.engine.max_lora_rank=12"])
    cfg = load_config("configs/tiny-cpu.yaml", ["learner.lora.rank=8", "learner.lora.target_modules=q_proj"])
    assert cfg.learner.lora.target_modules == ("q_proj",)  # one name where a list goes


def test_targets_that_match_nothing_list_the_models_layers(policy_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(policy_path)
    assert adapters.check_targets(config, LoraConfig(rank=8)) == 7 * config.num_hidden_layers  # all-linear
    with pytest.raises(UserError, match=r"learner.lora.target_modules=\['qkv'\] matches no module of Qwen2ForCausalLM; "
                                        r"its linear layers are \[.*'q_proj'.*\] \(or use all-linear\)"):
        adapters.check_targets(config, LoraConfig(rank=8, target_modules=("qkv",)))


@pytest.mark.parametrize("targets", [("q_proj", "lm_head"), ("embed_tokens",)])
def test_adapters_on_the_vocabulary_layers_are_refused(policy_path, targets):
    """vLLM refuses them at the first push (a run that fails after its start-up): refused up front."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(policy_path)
    with pytest.raises(UserError, match=rf"adapts (model\.)?{targets[-1]}: the generators' engine serves "
                                        "adapters on the decoder's linear layers only"):
        adapters.check_targets(config, LoraConfig(rank=8, target_modules=targets))


def test_a_quantized_base_is_refused(policy_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(policy_path)
    config.quantization_config = {"quant_method": "gptq", "bits": 4}
    with pytest.raises(UserError, match=r"model.policy is quantized \(gptq\); learner.lora trains adapters on a "
                                        "bf16 or fp32 base"):
        adapters.check_targets(config, LoraConfig(rank=8))


def test_a_resume_that_changes_the_adapter_is_refused(tmp_path):
    from cluster.config.ppo import load_config
    from cluster.runtime.state.checkpoint import CheckpointError, RunState, check_compatible, pinned_values

    saved = load_config("configs/tiny-cpu.yaml", ["learner.lora.rank=8"])
    state = RunState(step=2, version=2, batches_issued=2, unfinished=(), kl_beta=0.05,
                     pinned=json.loads(json.dumps(pinned_values(saved))))  # as the checkpoint's JSON keeps it
    check_compatible(state, saved, Path(tmp_path))  # the same settings resume
    for change, message in (("learner.lora.rank=16", "learner.lora.rank=16 differs from the checkpoint's 8"),
                            ("learner.lora.target_modules=[q_proj]", "learner.lora.target_modules=['q_proj'] differs"),
                            ("learner.lora.rank=0", "learner.lora.rank=0 differs")):
        now = load_config("configs/tiny-cpu.yaml", ["learner.lora.rank=8", change])
        with pytest.raises(CheckpointError, match=message.replace("[", r"\[")):
            check_compatible(state, now, Path(tmp_path))
    assert dataclasses.asdict(saved.learner.lora)["rank"] == 8



def test_a_reward_model_adapter_trains_its_score_head_and_exports_merged(policy_path, tmp_path):
    """The reward model's adapter: the body frozen, the score head trained whole; the export is the
    merged classifier and a PEFT adapter (score head as modules_to_save) that give the same score."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    from learner.objectives.preference import RewardModule

    torch.manual_seed(0)
    module = RewardModule.from_pretrained(policy_path, lora=LoraConfig(rank=8))
    trains = [n for n, p in module.named_parameters() if p.requires_grad]
    assert [n for n in trains if not adapters.is_adapter_param(n)] == ["model.score.weight"]
    with torch.no_grad():
        for name, p in module.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.1)
        ids = torch.tensor([[5, 17, 301, 44, 9]])
        mask = torch.ones_like(ids)
        want = module(ids, mask)
        module.save_pretrained(tmp_path)
        merged = RewardModule.from_pretrained(tmp_path)(ids, mask)
        base = AutoModelForSequenceClassification.from_pretrained(policy_path, num_labels=1)
        peft = RewardModule(PeftModel.from_pretrained(base, tmp_path / "adapter").base_model.model)(ids, mask)
    assert float((want - merged).abs()) < 1e-5 and float((want - peft).abs()) < 1e-5


@pytest.mark.parametrize("overrides", [
    ["reference.on_learner=true"],  # no adapter: the learner's weights are not the base
    ["reference.on_learner=true", "learner.lora.rank=8", "reference.model=/some/model"],
    ["reference.on_learner=true", "learner.lora.rank=8", "learner.zero_stage=3", "learner.replicas=2",
     "ppo.micro_batch_size=8", "data.prompts_per_step=16"],
])
def test_the_reference_on_the_learner_needs_an_adapter_and_rank_0_alone(overrides):
    from cluster.config.ppo import load_config
    from core.infra.errors import UserError as Refused

    with pytest.raises(Refused, match="reference.on_learner=true scores the reference on learner rank 0 as the "
                                      "policy with its LoRA adapter off: it needs learner.lora.rank > 0"):
        load_config("configs/tiny-cpu.yaml", overrides)
    cfg = load_config("configs/tiny-cpu.yaml", ["reference.on_learner=true", "learner.lora.rank=8"])
    assert cfg.reference.pool_replicas == 0 and cfg.reference.replicas == 1

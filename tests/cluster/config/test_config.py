"""Config loading: overrides, one-line validation errors, the shipped configs."""
from pathlib import Path

import pytest

from actors.rewards.source import one_source_rule
from cluster.config.ppo import ConfigError, describe, load_config

pytestmark = pytest.mark.unit
# PPO configs; the SFT and reward-model stages' own (sft-*, rm-*) are checked in test_stage_cli_errors.py,
# the pipeline's (pipeline-*) below.
CONFIGS = sorted(p for p in (Path(__file__).resolve().parents[3] / "configs").glob("*.yaml")
                 if not p.name.startswith(("sft-", "rm-", "pipeline-")))


def test_defaults_and_overrides():
    cfg = load_config(None, ["ppo.kl.beta=0.02", "generator.sampling.temperature=0.7",
                             "learner.optim.betas=[0.9, 0.99]", "reward.model=null",
                             "reward.function=cluster.demo.sentiment:sentiment"])
    assert cfg.ppo.kl.beta == 0.02
    assert cfg.learner.optim.betas == (0.9, 0.99)
    # The learner's logprobs always use the sampling temperature.
    assert cfg.learner_config().temperature == 0.7
    assert cfg.generator.sampling.temperature == 0.7


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    cfg = load_config(path)
    assert cfg.run.steps >= 1


def test_shipped_pipeline_config_validates():
    from cluster.config.pipeline import PipelineConfig
    from cluster.config.stages import load_stage_config

    path = Path(__file__).resolve().parents[3] / "configs" / "pipeline-cpu.yaml"
    cfg = load_stage_config(PipelineConfig, path)
    assert cfg.rl.run.steps >= 1 and cfg.pairs.gold == "cluster.demo.sentiment:gold"


def test_yaml_roundtrip_of_resolved_config(tmp_path):
    cfg = load_config(None, ["run.steps=3", "generator.replicas=2"])
    saved = tmp_path / "c.yaml"
    saved.write_text(cfg.to_yaml())
    assert load_config(saved) == cfg


def test_exponent_without_a_dot_is_a_number():
    # YAML 1.1 reads 6e-4 as a string; in a float field it is the number a user means.
    cfg = load_config(None, ["learner.optim.lr=6e-4", "ppo.kl.beta=1E-2"])
    assert cfg.learner.optim.lr == 6e-4 and cfg.ppo.kl.beta == 0.01
    assert load_config(None, ["learner.optim.lr=2.0e-4"]).learner.optim.lr == 2e-4


@pytest.mark.parametrize("overrides, message", [
    (["ppo.kl.bta=1"], "unknown key ppo.kl.bta; did you mean ppo.kl.beta?"),
    (["generatr.replicas=2"], "unknown key generatr; did you mean generator?"),
    (["ppo.kl.beta=abc"], "ppo.kl.beta must be float, got 'abc'"),
    (["ppo.kl.beta=1e"], "ppo.kl.beta must be float, got '1e'"),
    (["run.steps=2.5"], "run.steps must be int"),
    (["generator.engine.dtype=[1]"], "generator.engine.dtype must be str"),
    (["generator.engine.dtype=fp8"], "generator.engine.dtype='fp8' is not one of ['float32', 'bfloat16', 'float16']"),
    (["generator.engine.block_size=16"], "generator.engine.block_size=16 is not a block every vLLM backend takes"),
    (["model.dtype=fp16"], "model.dtype='fp16' is unknown; use one of auto, float32, bfloat16"),
    (["learner.dtype=float16"], "learner.dtype='float16' is unknown; use one of float32, bfloat16"),
    (["ppo.temperature=0.5"], "unknown key ppo.temperature"),
    (["learner.zero_stage=5"], "zero_stage=5 is out of range"),
    (["ppo.minibatch_size=7"], "minibatch_size=7 is not divisible"),
    (["learner.replicas=3", "ppo.minibatch_size=8", "ppo.micro_batch_size=2"], "not divisible by world_size"),
    (["generator.sampling.temperature=0"], "temperature must be > 0"),
    # each key named as the user wrote it, whichever section holds the setting
    (["generator.sampling.top_p=0"], "config: generator.sampling.top_p must be in (0, 1] (got 0.0)"),
    (["reward.function=null", "reward.judge.model=builtin:judge", "reward.judge.engine.dtype=fp8"],
     "config: reward.judge.engine.dtype='fp8' is not one of"),
    (["ppo.clip_low=1.5"], "config: ppo.clip_low=1.5 must be in (0, 1)"),
    (["reward.model=/x"], one_source_rule()),
    (["run.mode=fast"], "run.mode='fast' is unknown; use one of sync, async"),
    (["run.mode=1"], "run.mode must be str, got 1 (int)"),
    (["resources.cpu_threads=all"], "resources.cpu_threads='all' is unknown; use one of phase, reserved"),
    (["ppo.off_policy=is"], "ppo.off_policy='is' is unknown; use one of none, tis, decoupled"),
    (["learner.optim.decay=step"], "learner.optim.decay='step' is unknown; use one of linear, cosine, constant"),
    (["ppo.old_logprobs=vllm"], "ppo.old_logprobs='vllm' is unknown"),
    (["ppo.old_logprobs=behaviour", "run.mode=async"], "holds in sync mode only; set run.mode=sync"),
    (["generator.replicas=0"], "generator.replicas=0 must be >= 1"),
    (["data.prompts_per_step=2", "ppo.minibatch_size=16"], "lower the minibatch"),
    (["buffer.capacity=4"], "buffer.capacity=4 is below"),
    (["buffer.capacity=64", "run.mode=async", "generator.sampling.n=4"],
     "can stall async mode: the learner waits for a step's 64 rollouts while the producer waits for room "
     "for a chunk of up to 32; raise it to at least 95"),
    (["generator.tensor_parallel=2"], "needs generator.num_gpus >= 2"),
    (["generator.engine.tensor_parallel=2"], "unknown key generator.engine.tensor_parallel"),
    (["generator.engine.weight_sync=nccl"], "unknown key generator.engine.weight_sync"),
    (["learner.weight_sync=carrier-pigeon"], "weight_sync='carrier-pigeon' is unknown"),
    (["nonsense"], "must look like section.key=value"),
    (["run.plot_every=-1"], "must be >= 0"),
    (["ppo.kl.estimator=k3"], "ppo.kl.estimator=k3 in the reward does not give the KL's gradient"),
    (["ppo.kl.estimator=k2"], "or ppo.kl.placement=loss to train on k2 as a loss term"),
    (["ppo.kl.placement=loss"], "ppo.kl.estimator=k1 in the loss has zero expected gradient; use k3"),
    (["ppo.kl.placement=grad"], "ppo.kl.placement='grad' is unknown; use one of reward, loss"),
])
def test_each_mistake_is_one_clear_line(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    text = str(info.value)
    assert message in text
    assert "\n" not in text


def test_the_generation_budget_reaches_the_learner():
    """seq-mean-token-sum-norm divides by a constant (Dr. GRPO): the job's max_new_tokens."""
    from learner.config import LearnerConfig, PPOConfig
    cfg = load_config(None, ["generator.sampling.max_new_tokens=24", "ppo.agg=seq-mean-token-sum-norm"])
    assert cfg.learner_config().max_new_tokens == 24
    with pytest.raises(ValueError, match="ppo.agg=seq-mean-token-sum-norm divides by the generation budget"):
        LearnerConfig(ppo=PPOConfig(agg="seq-mean-token-sum-norm")).validate()
    LearnerConfig(ppo=PPOConfig(agg="seq-mean-token-sum-norm"), max_new_tokens=24).validate()


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: {steps: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(top)


def test_describe_lists_every_leaf_with_its_comment():
    text = describe()
    assert "ppo.kl.beta = 0.05    # initial weight of the per-token KL penalty" in text
    assert "generator.num_cpus = 1.0" in text  # inherited pool fields are listed too
    assert "ppo.temperature" not in text


def test_config_is_frozen_and_declared_once():
    import dataclasses

    from learner.config import TrainerConfig

    cfg = load_config(None, ["learner.zero_stage=3"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.learner.zero_stage = 1
    # The learner section IS the learner's own declaration, not a copy of it.
    assert isinstance(cfg.learner, TrainerConfig)
    assert cfg.learner_config().zero_stage == 3

"""Typed configs of the two stages PPO starts from: SFT (cluster/recipes/sft.py) and the reward
model (cluster/recipes/reward_model.py). Same conventions as cluster/config/ppo.py: YAML + dotted
overrides, frozen dataclasses, every mistake one line naming the key; the learner, run
folder and Ray sections are the PPO config's own classes.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional

from cluster.config.ppo import (
    BUILTIN_POLICY,
    ConfigError,
    LearnerPoolConfig,
    ResourcesConfig,
    TetherConfig,
    build_section,
    check_run_name,
    read_config,
)
from learner.config import LearnerConfig, PPOConfig, TrainerConfig


@dataclass(frozen=True)
class StageModelConfig:
    base: str = BUILTIN_POLICY       # SFT: the causal LM to fine-tune; RM: the SFT checkpoint or SFT run folder (builtin:tiny or a directory)
    tokenizer: Optional[str] = None  # defaults to the base model's own


@dataclass(frozen=True)
class StageDataConfig:
    path: Optional[str] = None       # .jsonl / .parquet / saved HF dataset; null = built-in tiny examples
    prompt_field: str = "prompt"     # the prompt column
    chat_template: bool = False      # wrap prompts in the tokenizer's chat template (refused if it has none)
    append_eos: bool = True          # end every response with EOS, as the generator's responses end
    max_seq_len: int = 128           # prompt + response tokens; longer rows are skipped and counted
    eval_examples: int = 16          # rows held out for the per-epoch evaluation
    seed: int = 0                    # held-out split and per-epoch shuffling


@dataclass(frozen=True)
class SFTDataConfig(StageDataConfig):
    response_field: str = "response"  # the response column: the only tokens the loss counts


@dataclass(frozen=True)
class PairDataConfig(StageDataConfig):
    chosen_field: str = "chosen"     # the preferred response
    rejected_field: str = "rejected"  # the other one


@dataclass(frozen=True)
class StageTrainConfig:
    epochs: int = 1                  # passes over the training rows
    batch_size: int = 8              # rows per optimizer step, over all learner ranks
    micro_batch_size: int = 4        # rows per forward/backward on one rank (gradient accumulation)


@dataclass(frozen=True)
class RMTrainConfig(StageTrainConfig):
    margin: float = 0.0              # Bradley-Terry margin: the chosen score must beat the rejected by this


@dataclass(frozen=True)
class StageRunConfig:
    dir: str = "runs"                # run folders are created under this directory
    name: Optional[str] = None       # run folder name; default: timestamp
    seed: int = 0                    # seeds the learner (score-head init)
    library_logs: bool = False       # show Hugging Face / DeepSpeed console logs


@dataclass(frozen=True)
class StageConfig:
    model: StageModelConfig = field(default_factory=StageModelConfig)
    learner: LearnerPoolConfig = field(default_factory=LearnerPoolConfig)
    run: StageRunConfig = field(default_factory=StageRunConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)

    def learner_config(self) -> LearnerConfig:
        """The engine's settings: the learner section; the stage's batch sizes are the DeepSpeed
        batch sizes, which LearnerConfig keeps in its ppo part."""
        trainer = {f.name: getattr(self.learner, f.name) for f in fields(TrainerConfig)}
        t = self.train
        return LearnerConfig(**{**trainer, "critic": "shared", "critic_model": None},
                             ppo=PPOConfig(minibatch_size=t.batch_size, micro_batch_size=t.micro_batch_size),
                             seed=self.run.seed)

    to_dict, to_yaml = TetherConfig.to_dict, TetherConfig.to_yaml  # config.yaml of the run folder

    def validate(self) -> None:
        t, d, lp = self.train, self.data, self.learner
        if lp.replicas < 1 or lp.num_cpus < 0 or lp.num_gpus < 0:
            raise ConfigError("config: learner.replicas must be >= 1 and learner.num_cpus/num_gpus >= 0")
        if min(t.epochs, t.batch_size, t.micro_batch_size) < 1:
            raise ConfigError("config: train.epochs, train.batch_size and train.micro_batch_size must be >= 1")
        per_step = lp.replicas * t.micro_batch_size
        if t.batch_size % per_step:
            raise ConfigError(f"config: train.batch_size={t.batch_size} is not divisible by learner.replicas x "
                              f"train.micro_batch_size = {per_step}; make it a multiple of {per_step}")
        if d.max_seq_len < 2:
            raise ConfigError(f"config: data.max_seq_len={d.max_seq_len} must be >= 2")
        if d.eval_examples < lp.replicas:
            raise ConfigError(f"config: data.eval_examples={d.eval_examples} must be >= learner.replicas="
                              f"{lp.replicas} (each rank evaluates a share of the held-out rows)")
        check_run_name(self.run.name)
        try:
            self.learner_config().validate(world_size=lp.replicas)
        except ValueError as e:
            raise ConfigError(f"config: {e}") from None


@dataclass(frozen=True)
class SFTConfig(StageConfig):
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    train: StageTrainConfig = field(default_factory=StageTrainConfig)


@dataclass(frozen=True)
class RMConfig(StageConfig):
    data: PairDataConfig = field(default_factory=PairDataConfig)
    train: RMTrainConfig = field(default_factory=RMTrainConfig)


def load_stage_config(cls, path: str | Path | None, overrides: list[str] = ()):
    """``cls`` (SFTConfig or RMConfig) from YAML + overrides, validated once and frozen."""
    cfg = build_section(cls, read_config(path, overrides), "", root=cls)
    cfg.validate()
    return cfg

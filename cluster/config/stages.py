"""Typed configs of the two stages PPO starts from: SFT (cluster/recipes/sft.py) and the reward
model (cluster/recipes/reward_model.py). Same conventions as cluster/config/ppo.py: YAML + dotted
overrides (cluster/config/loader.py), frozen config classes whose keys carry their help, every
mistake one line naming the key; the learner and Ray sections are the PPO config's own classes.
"""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Optional

from cluster.config import loader
from cluster.config.labels import check_node_labels
from cluster.config.loader import ConfigError, RootConfig
from cluster.config.ppo import BUILTIN_POLICY, LearnerPoolConfig, ResourcesConfig, check_run_name
from cluster.config.tracking import TRACKERS_HELP, TrackingConfig, tracker_names
from core.infra.schema import config_class, setting
from learner.config import SupervisedConfig, TrainerConfig


@config_class
class StageModelConfig:
    """The model the stage starts from."""
    base: str = setting(BUILTIN_POLICY, "SFT: the causal LM to fine-tune; RM: the SFT checkpoint or SFT run "
                                        "folder (builtin:tiny or a directory)")
    tokenizer: Optional[str] = setting(None, "defaults to the base model's own")


@config_class
class StageDataConfig:
    """The training rows: where they come from and how they are tokenized and split."""
    path: Optional[str] = setting(None, ".jsonl / .parquet / saved HF dataset, or a Hub dataset id owner/name; "
                                        "null = built-in tiny examples")
    split: str = setting("train", "the split of a Hub dataset or saved DatasetDict")
    config_name: Optional[str] = setting(None, "the config of a Hub dataset that has several")
    prompt_field: str = setting("prompt", "the prompt column")
    chat_template: bool = setting(False, "wrap prompts in the tokenizer's chat template (refused if it has none)")
    append_eos: bool = setting(True, "end every response with EOS, as the generator's responses end")
    max_seq_len: int = setting(128, "prompt + response tokens; longer rows are skipped and counted")
    eval_examples: int = setting(16, "rows held out for the per-epoch evaluation")
    seed: int = setting(0, "held-out split and per-epoch shuffling")


@config_class
class SFTDataConfig(StageDataConfig):
    """The SFT rows: a prompt and the response to imitate."""
    response_field: str = setting("response", "the response column: the only tokens the loss counts")


@config_class
class PairDataConfig(StageDataConfig):
    """The preference pairs: a prompt, the preferred response and the other one."""
    chosen_field: str = setting("chosen", "the preferred response")
    rejected_field: str = setting("rejected", "the other one")


@config_class
class StageTrainConfig:
    """Epochs and batch sizes of the stage's training."""
    epochs: int = setting(1, "passes over the training rows")
    batch_size: int = setting(8, "rows per optimizer step, over all learner ranks")
    micro_batch_size: int = setting(4, "rows per forward/backward on one rank (gradient accumulation)")
    packing: bool = setting(True, "each micro-batch as one row of its real tokens, no padding, attended per "
                                  "sequence")


@config_class
class RMTrainConfig(StageTrainConfig):
    """Epochs, batch sizes and the Bradley-Terry margin of the reward model's training."""
    margin: float = setting(0.0, "Bradley-Terry margin: the chosen score must beat the rejected by this")


@config_class
class StageRunConfig:
    """The run folder and seed."""
    dir: str = setting("runs", "run folders are created under this directory")
    name: Optional[str] = setting(None, "run folder name; default: timestamp")
    seed: int = setting(0, "seeds the learner (score-head init)")
    library_logs: bool = setting(False, "show Hugging Face / DeepSpeed console logs")
    trackers: tuple[str, ...] = setting((), TRACKERS_HELP)
    tracking: TrackingConfig

    def tracker_names(self) -> tuple[str, ...]:
        return tracker_names(self.trackers)


@config_class
class StageConfig(RootConfig):
    """What the SFT and reward-model stages share: model, learner pool, run folder, Ray."""
    model: StageModelConfig
    learner: LearnerPoolConfig
    run: StageRunConfig
    resources: ResourcesConfig

    def learner_config(self) -> SupervisedConfig:
        """The engine's settings: the learner section, with the train section's batch sizes
        (the DeepSpeed batch sizes) and the run's seed."""
        trainer = {f.name: getattr(self.learner, f.name) for f in fields(TrainerConfig)}
        t = self.train
        return SupervisedConfig(**{**trainer, "critic": "shared", "critic_model": None},
                                batch_size=t.batch_size, micro_batch_size=t.micro_batch_size, packing=t.packing,
                                seed=self.run.seed)

    def validate(self) -> None:
        t, d, lp = self.train, self.data, self.learner
        if lp.replicas < 1 or lp.num_cpus < 0 or lp.num_gpus < 0:
            raise ConfigError("config: learner.replicas must be >= 1 and learner.num_cpus/num_gpus >= 0")
        check_node_labels("learner.node_labels", lp.node_labels)
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


@config_class
class SFTConfig(StageConfig):
    """Supervised fine-tuning of the policy PPO starts from."""
    data: SFTDataConfig
    train: StageTrainConfig


@config_class
class RMConfig(StageConfig):
    """The reward model PPO trains against, fitted to preference pairs."""
    data: PairDataConfig
    train: RMTrainConfig


def load_stage_config(cls, path: str | Path | None, overrides: list[str] = ()):
    """``cls`` (SFTConfig or RMConfig, or another root config) from YAML + overrides, validated once and frozen."""
    return loader.load(cls, path, overrides)

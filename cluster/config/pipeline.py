"""Typed config of the pipeline (python -m cluster.pipeline, cluster/recipes/pipeline.py) and of the
KL sweep over its folder: the pairs stage's own settings, the pipeline folder, and the SFT,
reward-model and PPO configs of its stages; ``linked_rl`` fills in what links PPO to the others.
"""
from __future__ import annotations

import dataclasses
from dataclasses import replace
from typing import Optional

from cluster.config.loader import ConfigError, RootConfig
from cluster.config.ppo import RewardPoolConfig, TetherConfig, check_run_name, validate
from cluster.config.stages import RMConfig, SFTConfig
from cluster.config.tracking import TRACKERS_HELP, TrackingConfig, tracker_names
from core.choices import PairLabels
from core.infra.schema import config_class, setting


@config_class
class PairsConfig:
    """The gold-labelled preference pairs sampled from the SFT model."""
    gold: str = setting("cluster.demo.sentiment:gold", "the hidden labeller: "
                                                       "module:function(prompts, responses) -> floats")
    prompts: int = setting(24, "training prompts (of rl's prompt set) sampled for pairs")
    samples_per_prompt: int = setting(4, "K responses per prompt from the SFT model")
    pairs_per_prompt: int = setting(2, "labelled pairs kept per prompt (ties and duplicates are skipped)")
    labels: PairLabels = setting("hard", "hard (higher gold score chosen) | bradley_terry "
                                         "(chosen w.p. sigmoid(gold gap))")
    seed: int = setting(0, "sampling and pair selection")


@config_class
class PipelineRunConfig:
    """The pipeline folder."""
    dir: str = setting("runs", "the pipeline folder is created under this directory")
    name: Optional[str] = setting(None, "pipeline folder name; default: timestamp")
    trackers: tuple[str, ...] = setting((), TRACKERS_HELP + "; every stage's, replacing the stages' own")
    tracking: TrackingConfig

    def tracker_names(self) -> tuple[str, ...]:
        return tracker_names(self.trackers)


@config_class
class PipelineConfig(RootConfig):
    """SFT -> gold-labelled pairs -> proxy reward model -> PPO against the proxy, one run folder."""
    pairs: PairsConfig
    sft: SFTConfig
    rm: RMConfig
    rl: TetherConfig
    run: PipelineRunConfig

    def validate(self) -> None:
        p = self.pairs
        if p.prompts < 1 or p.samples_per_prompt < 2 or p.pairs_per_prompt < 1:
            raise ConfigError("config: pairs.prompts and pairs.pairs_per_prompt must be >= 1 and "
                              "pairs.samples_per_prompt >= 2 (a pair needs two responses)")
        check_run_name(self.run.name)
        checks = (("sft", self.sft.validate), ("rm", self.rm.validate),
                  ("rl", lambda: validate(linked_rl(self.rl, policy="sft", reward_model="rm", gold=p.gold))))
        for section, check in checks:
            try:
                check()
            except ConfigError as e:  # the stages' messages name their own keys: say which stage
                raise ConfigError(str(e).replace("config: ", f"config: [{section}] ", 1)) from None


def has_gold_key() -> bool:
    """Whether this checkout's PPO config has ``reward.gold`` (the eval-only gold scorer)."""
    return "gold" in {f.name for f in dataclasses.fields(RewardPoolConfig)}


def linked_rl(rl: TetherConfig, *, policy: str, reward_model: str, gold: str, run_dir: str | None = None,
              name: str = "ppo") -> TetherConfig:
    """rl with the pipeline's links: policy and reference = the SFT model, reward = the proxy."""
    reward = replace(rl.reward, model=reward_model, function=None, normalize=True,
                     **({"gold": gold} if has_gold_key() else {}))
    run = replace(rl.run, dir=run_dir or rl.run.dir, name=name)
    return replace(rl, model=replace(rl.model, policy=policy), reference=replace(rl.reference, model=None),
                   reward=reward, run=run)

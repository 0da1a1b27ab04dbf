"""Which source scores a PPO run's rollouts, decided once from the config (``cfg``: a TetherConfig).

Exactly one of reward.function, reward.model, reward.url and reward.judge.model is set
(cluster/config/ppo.py checks it), but with ``env.reward: environment`` none of them scores:
the episodes' own rewards do. Every place that says or sizes the reward (the start-up line,
the memory estimate, the pools started, the invalid-scores message) asks ``reward_source``,
so none of them can read the wrong setting.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RewardKind = Literal["function", "model", "url", "judge", "environment"]

# How messages name each kind of source, before its spec.
_LABELS = {"function": "reward function", "model": "reward model", "url": "reward server",
           "judge": "reward judge", "environment": "environment"}


@dataclass(frozen=True)
class RewardSource:
    kind: RewardKind
    spec: str  # the function's module:function, the model's path, the URL, the judge model, the environment class

    @property
    def name(self) -> str:
        """For messages: "reward function mod:fn", "environment mod:Class", ..."""
        return f"{_LABELS[self.kind]} {self.spec}"

    @property
    def holds_model(self) -> bool:
        """Whether the reward replicas load a model of their own (its weights in their memory)."""
        return self.kind in ("model", "judge")


def reward_source(cfg) -> RewardSource:
    """The source of the scores the run trains on."""
    if cfg.env.enabled and cfg.env.reward == "environment":
        return RewardSource("environment", cfg.env.environment)
    w = cfg.reward
    for kind, spec in (("function", w.function), ("model", w.model), ("url", w.url), ("judge", w.judge.model)):
        if spec is not None:
            return RewardSource(kind, spec)
    raise ValueError("reward_source: no reward is set; the config check requires one of reward.function, "
                     "reward.model, reward.url and reward.judge.model")


def reward_pool_replicas(cfg) -> int:
    """The reward pool's replicas: none when the environment scores and no reward.gold needs a
    replica to score the evaluation (then the dispatcher reads the episodes' scores without one,
    cluster/runtime/pools/environment_scores.py)."""
    if reward_source(cfg).kind == "environment" and cfg.reward.gold is None:
        return 0
    return cfg.reward.replicas


def without_unused_reward(cfg):
    """``cfg`` as start-up checks it: with the environment scoring, the reward.* sources cleared,
    so that none is loaded, probed or asked for its columns (reward.gold, still called on the
    evaluation, stays)."""
    from dataclasses import replace

    if reward_source(cfg).kind != "environment":
        return cfg
    w = cfg.reward
    return replace(cfg, reward=replace(w, function=None, model=None, url=None, judge=replace(w.judge, model=None)))

"""A step that the reward scores mostly as invalid stops the run, naming the reward.

An invalid score (NaN or inf, or a reward call that raised) leaves its rollout out of
training and is counted in rollouts/invalid_scores: a few are how a reward says "no score
for this one". Most of a step means the reward is broken, and the run would go on training
on what is left. So above ``reward.max_invalid_fraction`` of a step's scored rollouts the
run stops with one line naming the reward (exit 2, as the other mistakes the user fixes;
the start-up probe refuses a reward function that scores nothing finite before any of this).
"""
from __future__ import annotations

from core.infra.errors import InputError


class InvalidScores(InputError):
    """Too many of a step's scores were invalid: the user's to fix (cluster.train exits 2)."""


def check_invalid_scores(produced, reward, step: int) -> None:
    """Raise InvalidScores if ``produced`` (cluster.runtime.observe.produced.Produced, what fed step ``step``)
    has more invalid scores than ``reward.max_invalid_fraction`` (the config's reward section) allows."""
    scored = produced.stored + produced.invalid_scores + produced.empty_responses
    if not scored or produced.invalid_scores <= reward.max_invalid_fraction * scored:
        return
    name = (f"reward function {reward.function}" if reward.function else
            f"reward server {reward.url}" if reward.url else
            f"reward judge {reward.judge.model}" if reward.judge.model else f"reward model {reward.model}")
    raise InvalidScores(f"{name}: {produced.invalid_scores} of {scored} scores at step {step} were invalid (NaN or "
                        "inf, or the reward raised; the log's 'reward:' lines say why), above "
                        f"reward.max_invalid_fraction={reward.max_invalid_fraction:g}; fix the reward, or raise "
                        "reward.max_invalid_fraction to train on the rest")

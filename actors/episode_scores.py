"""The episodes' own scores without a reward replica (``env.reward: environment``).

With the environment scoring, a reward replica would only pass each episode's summed rewards
on (``environment_scores``, actors/episodes.py): no model, no function. So the run starts no
reward pool, and the dispatcher and the evaluation call these functions as Ray tasks where
they would call a replica's methods of the same names (cluster/runtime/pools/environment_scores.py).
This module imports no torch: a task's worker process stays small.
"""
from __future__ import annotations

import os

from actors.episodes import environment_scores
from actors.scoring import ScoreResult
from core.infra.transfer import Pull, Transfer, pull_args


def score_rollouts(rollouts: list) -> ScoreResult:
    """Reward.score_rollouts with ``from_environment``: the episodes' environment scores."""
    return environment_scores(rollouts)


def score_rollouts_pulled(rollouts: Pull) -> tuple[ScoreResult, Transfer]:
    """Reward.score_rollouts_pulled: the scores of rollouts this call pulls itself (num_returns=2),
    and what the pull moved between nodes."""
    (rollouts,), moved = pull_args(rollouts)
    return environment_scores(rollouts), moved


def health() -> dict:
    """Reward.health's answer for a scorer that is a task: always there while Ray is."""
    return {"role": "reward", "ok": True, "pid": os.getpid(), "scorer": "environment"}

"""The environment as a reward source (``env.reward: environment``): the episodes' own scores,
and any reward's scores with the items of failed episodes made invalid.

With the environment scoring, a reward replica would only pass each episode's summed rewards
on (``environment_scores``): no model, no function. So the run starts no
reward pool, and the dispatcher and the evaluation call these functions as Ray tasks where
they would call a replica's methods of the same names (cluster/runtime/pools/environment_scores.py).
This module imports no torch: a task's worker process stays small.
"""
from __future__ import annotations

import os
from dataclasses import replace

import numpy as np

from actors.rewards.scoring import ScoreResult
from core.infra.transfer import Pull, Transfer, pull_args
from core.rollout import Rollout


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


def environment_scores(rollouts: list[Rollout]) -> ScoreResult:
    """The episodes' own scores (their environment rewards summed) as a reward's result: an
    invalid episode's item invalid, one line per reason with its count."""
    scores = np.array([np.nan if r.env_score is None else r.env_score for r in rollouts], dtype=np.float32)
    unplayed = "the rollout was not played against an environment"
    return _void(ScoreResult(scores, np.isfinite(scores)), rollouts, unplayed)


def void_invalid_episodes(result: ScoreResult, rollouts: list[Rollout]) -> ScoreResult:
    """A reward's ``result`` on episodes' transcripts with each invalid episode's item made
    invalid: an episode its environment failed is not scored, whatever the reward says."""
    if not any(r.env_error for r in rollouts):
        return result
    failed = np.array([bool(r.env_error) for r in rollouts])
    voided = replace(result, valid=result.valid & ~failed, errors=list(result.errors))
    return _void(voided, rollouts, "")


def _void(result: ScoreResult, rollouts: list[Rollout], unknown: str) -> ScoreResult:
    """``result`` with NaN at its invalid items and a line per episode failure reason and count."""
    reasons: dict[str, int] = {}
    for r, ok in zip(rollouts, result.valid):
        if not ok and (r.env_error or unknown):
            why = r.env_error or unknown
            reasons[why] = reasons.get(why, 0) + 1
    errors = result.errors + [f"{why} ({n} of {len(rollouts)} episodes invalid)" for why, n in reasons.items()]
    scores = np.where(result.valid, result.scores, np.nan).astype(np.float32)
    return replace(result, scores=scores, errors=errors)

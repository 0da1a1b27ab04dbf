"""annotate: join a generator's Rollouts with reference log-probs and reward scores.

Pure function (numpy in, numpy out, torch only for the shared PPO math), so the
reward shaping the learner trains on is defined in exactly one place: core/advantages.py.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from core.advantages import per_token_rewards, per_turn_rewards, shaped_scores
from core.kl import KLPenalty, kl_estimate
from core.rollout import Rollout, ScoredRollout

log = logging.getLogger(__name__)

_ROLLOUT_FIELDS = tuple(f.name for f in dataclasses.fields(Rollout))


@dataclass(frozen=True)
class RewardShaping:
    """How scores and the KL to the reference become per-token rewards (see ``annotate``)."""
    beta: float                          # weight of the per-token KL penalty (the controller's current value)
    kl_estimator: str = "k1"
    truncation_penalty: float = 0.0
    reward_clip: Optional[float] = None

    @classmethod
    def for_step(cls, kl: KLPenalty, *, truncation_penalty: float = 0.0,
                 reward_clip: Optional[float] = None) -> "RewardShaping":
        """The shaping of one step's KL penalty ``kl``: it enters the rewards only when it is not
        a loss term (``kl.reward_beta``); either way the KL is measured with its estimator, which
        the KL controller reads."""
        return cls(beta=kl.reward_beta, kl_estimator=kl.estimator,
                   truncation_penalty=truncation_penalty, reward_clip=reward_clip)


def annotate_valid(rollouts: Sequence[Rollout], ref_logprobs: Sequence[np.ndarray], scores: np.ndarray,
                   valid: np.ndarray, shaping: RewardShaping,
                   teacher_logprobs: Optional[Sequence[np.ndarray]] = None) -> tuple[list[ScoredRollout], int, int]:
    """``annotate`` of the rollouts whose score is valid: (scored, n_invalid, n_empty).

    scores and valid are [N] (a reward's ScoreResult); invalid items are left out and counted.
    """
    keep = np.flatnonzero(np.asarray(valid, dtype=bool))
    scored = annotate([rollouts[i] for i in keep], [ref_logprobs[i] for i in keep],
                      np.asarray(scores)[keep], beta=shaping.beta, kl_estimator=shaping.kl_estimator,
                      truncation_penalty=shaping.truncation_penalty, reward_clip=shaping.reward_clip,
                      teacher_logprobs=None if teacher_logprobs is None else [teacher_logprobs[i] for i in keep])
    return scored, len(rollouts) - len(keep), len(keep) - len(scored)


def _name(r: Rollout) -> str:
    return f"rollout (prompt_index={r.prompt_index}, sample_index={r.sample_index})"


def annotate(rollouts: Sequence[Rollout], ref_logprobs: Sequence[np.ndarray], scores: np.ndarray, *,
             beta: float, kl_estimator: str = "k1", truncation_penalty: float = 0.0,
             reward_clip: Optional[float] = None,
             teacher_logprobs: Optional[Sequence[np.ndarray]] = None) -> list[ScoredRollout]:
    """Turn rollouts into ScoredRollouts with per-token KL and rewards.

    ref_logprobs[i] is [R_i] (Reference.logprobs output); scores is [N], one per rollout,
    all finite (filter invalid reward items first: a NaN here is a ValueError).
    kl_t = kl_estimate(behaviour_logprobs, reference_logprobs, kl_estimator);
    rewards_t = -beta * kl_t, plus on the last response token the score
    (clipped to +-reward_clip if given) plus truncation_penalty when
    finish_reason == "length" (the penalty is added: pass a negative number).
    ScoredRollout.score keeps the raw score. A rollout with ``turn_rewards`` (an episode
    rewarded turn by turn) gets them, each clipped, on its turns' last tokens instead of the
    score on its last token (core.advantages.per_turn_rewards).

    Rollouts with an empty response have no token to carry a reward and are left
    out: the result keeps input order, and ``len(rollouts) - len(result)`` is the
    number skipped (each result still names its prompt_index / sample_index).
    ``teacher_logprobs[i]`` [R_i], where the run has a teacher: kept on the ScoredRollout as
    they are (the learner turns them into an advantage term, core/distill.py).
    """
    n = len(rollouts)
    if len(ref_logprobs) != n or (teacher_logprobs is not None and len(teacher_logprobs) != n):
        raise ValueError(f"annotate: {n} rollouts but {len(ref_logprobs)} reference log-prob arrays"
                         + ("" if teacher_logprobs is None else f" and {len(teacher_logprobs)} teacher ones"))
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    if scores.shape != (n,):
        raise ValueError(f"annotate: {n} rollouts but {scores.size} scores")
    teachers = [None] * n if teacher_logprobs is None else teacher_logprobs
    keep, refs, kept_scores, kept_teachers = _non_empty(rollouts, ref_logprobs, scores, teachers)
    if len(keep) < n:
        log.debug("annotate: skipped %d rollouts with empty responses", n - len(keep))
    if not keep:
        return []
    lengths = [r.response_ids.size for r in keep]
    kl_np, rewards_np, shaped, placed_np = _kl_and_rewards(
        keep, refs, kept_scores, beta=beta, kl_estimator=kl_estimator, truncation_penalty=truncation_penalty,
        reward_clip=reward_clip)
    out = []
    for row, (r, ref, teacher, R) in enumerate(zip(keep, refs, kept_teachers, lengths)):
        base = {name: getattr(r, name) for name in _ROLLOUT_FIELDS}
        out.append(ScoredRollout(**base, reference_logprobs=ref, teacher_logprobs=teacher, kl=kl_np[row, :R].copy(),
                                 rewards=rewards_np[row, :R].copy(), score=float(kept_scores[row]),
                                 reward_score=float(shaped[row]),
                                 placed_rewards=None if r.turn_rewards is None else placed_np[row, :R].copy()))
    return out


def _non_empty(rollouts: Sequence[Rollout], ref_logprobs: Sequence[np.ndarray], scores: np.ndarray,
               teachers: Sequence) -> tuple[list[Rollout], list[np.ndarray], np.ndarray, list]:
    """The rollouts with a response, their [R_i] float32 reference log-probs, their [N'] float64
    scores and their [R_i] float32 teacher log-probs (None entries without a teacher); a ValueError
    for a length mismatch or a non-finite score or log-prob among them."""
    keep, refs, kept_scores, kept_teachers = [], [], [], []
    for r, ref, s, teacher in zip(rollouts, ref_logprobs, scores, teachers):
        ref = np.asarray(ref, dtype=np.float32).reshape(-1)
        if r.trained_tokens == 0:  # nothing the policy sampled: nothing to train
            continue
        if teacher is not None:
            teacher = np.asarray(teacher, dtype=np.float32).reshape(-1)
        for name, lp in (("reference", ref), ("teacher", teacher)):
            if lp is not None and lp.shape != r.response_ids.shape:
                raise ValueError(f"annotate: {_name(r)} has {r.response_ids.size} response tokens but "
                                 f"{lp.size} {name} log-probs")
        if not np.isfinite(s):
            raise ValueError(f"annotate: {_name(r)} has non-finite score {s}; drop invalid reward items first")
        if not (np.isfinite(ref).all() and np.isfinite(r.behaviour_logprobs).all()
                and (teacher is None or np.isfinite(teacher).all())):
            raise ValueError(f"annotate: {_name(r)} has non-finite behaviour, reference or teacher log-probs")
        keep.append(r)
        refs.append(ref)
        kept_scores.append(s)
        kept_teachers.append(teacher)
    return keep, refs, np.array(kept_scores), kept_teachers


def _kl_and_rewards(keep: list[Rollout], refs: list[np.ndarray], scores: np.ndarray, *, beta: float,
                    kl_estimator: str, truncation_penalty: float,
                    reward_clip: Optional[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per-token KL and rewards, each [B, T] float32 (T = the longest response; 0 past a row's end),
    the [B] float32 scores as they entered the rewards and [B, T] the turn rewards as they entered
    them (0 on rows rewarded as a whole), of non-empty rollouts with their reference log-probs and
    [B] scores (see ``annotate``)."""
    B, T = len(keep), max(r.response_ids.size for r in keep)
    behaviour = np.zeros((B, T), np.float32)
    reference = np.zeros((B, T), np.float32)
    mask = np.zeros((B, T), bool)
    for row, (r, ref) in enumerate(zip(keep, refs)):
        behaviour[row, :r.response_ids.size] = r.behaviour_logprobs
        reference[row, :r.response_ids.size] = ref
        # Only the policy's tokens: an environment's get no KL and no reward, the score goes on
        # the last token the policy sampled.
        mask[row, :r.response_ids.size] = True if r.action_mask is None else r.action_mask
    with torch.no_grad():
        mask_t = torch.from_numpy(mask)
        kl = kl_estimate(torch.from_numpy(behaviour), torch.from_numpy(reference), kl_estimator)
        kl = torch.where(mask_t, kl, torch.zeros(()))
        shaping = dict(truncated=torch.tensor([r.truncated for r in keep]),
                       truncation_penalty=truncation_penalty, reward_clip=reward_clip)
        score = torch.from_numpy(scores.astype(np.float32))
        rewards = per_token_rewards(kl, score, mask_t.float(), beta, **shaping)
        shaped = shaped_scores(score, **shaping)
        by_turn = torch.tensor([r.turn_rewards is not None for r in keep])
        placed = torch.zeros((B, T))
        if bool(by_turn.any()):  # these rows' rewards sit on their turns' last tokens instead
            turns = torch.zeros((B, T))
            for row, r in enumerate(keep):
                if r.turn_rewards is not None:
                    turns[row, :r.response_ids.size] = torch.from_numpy(r.turn_rewards)
            turn_dense, placed = per_turn_rewards(kl, turns, mask_t.float(), beta, **shaping)
            rewards = torch.where(by_turn[:, None], turn_dense, rewards)
            shaped = torch.where(by_turn, placed.sum(dim=1), shaped)
    return kl.numpy(), rewards.numpy(), shaped.numpy(), placed.numpy()

"""From scores and KL to training targets: dense per-token rewards and generalised
advantage estimation. Conventions as in core.masked.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from core.masked import check_masked, check_shapes, require, zero_pad

Tensor = torch.Tensor


def last_valid_column(mask: Tensor) -> Tensor:
    """[B] int64 the column of each row's last valid token of ``mask`` [B, T], gaps allowed
    (a multi-turn transcript's environment tokens); -1 for a row without one."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask != 0, positions, -1).amax(dim=1)


def _last_valid_index(fn: str, mask: Tensor) -> Tensor:
    last = last_valid_column(mask)
    if bool((last < 0).any()):
        rows = (last < 0).nonzero().flatten().tolist()
        raise ValueError(f"{fn}: rows {rows} of mask have no valid tokens")
    return last


def shaped_scores(scores: Tensor, *, truncated: Optional[Tensor] = None, truncation_penalty: float = 0.0,
                  reward_clip: Optional[float] = None, dtype: torch.dtype = torch.float32) -> Tensor:
    """[B] each score as it enters the rewards, in ``dtype``: ``scores`` [B] clipped to
    [-reward_clip, reward_clip] if given, then ``truncation_penalty`` ADDED on the rows with
    ``truncated`` [B] (bool, cut at max length without EOS; a penalty is normally negative,
    e.g. -1.0, and is not clipped)."""
    fn = "shaped_scores"
    require(reward_clip is None or reward_clip > 0,
            f"{fn}: reward_clip must be > 0 or None, got {reward_clip}")
    score = scores.to(dtype)
    if reward_clip is not None:
        score = score.clamp(-reward_clip, reward_clip)
    if truncated is not None:
        check_shapes(fn, "scores", scores.shape, truncated=truncated)
        score = score + truncated.to(torch.bool).to(score.dtype) * truncation_penalty
    return score


def per_token_rewards(
    kl: Tensor, scores: Tensor, mask: Tensor, beta: float, *,
    truncated: Optional[Tensor] = None, truncation_penalty: float = 0.0, reward_clip: Optional[float] = None,
) -> Tensor:
    """Dense PPO rewards [B, T]: ``-beta * kl`` per valid token, the shaped score on the last one.

    kl: [B, T] per-token KL estimate; scores: [B] reward-model score per sequence;
    mask: [B, T]. The score, shaped by ``shaped_scores`` (clip, truncation penalty), is
    placed only on each row's last valid token (the EOS, or the final token of a truncated
    response), never broadcast. Padding is 0. Gradients are not stopped: call under
    ``torch.no_grad()``.
    """
    fn = "per_token_rewards"
    require(mask.dim() == 2, f"{fn}: mask must be 2-D [B, T], got shape {tuple(mask.shape)}")
    check_shapes(fn, "mask", mask.shape, kl=kl)
    check_shapes(fn, "mask rows", mask.shape[:1], scores=scores)
    if truncated is not None:
        check_shapes(fn, "mask rows", mask.shape[:1], truncated=truncated)
    require(beta >= 0, f"{fn}: beta must be >= 0, got {beta}")
    last = _last_valid_index(fn, mask)
    score = shaped_scores(scores, truncated=truncated, truncation_penalty=truncation_penalty,
                          reward_clip=reward_clip, dtype=kl.dtype)
    rewards = zero_pad(-beta * kl, mask)
    rows = torch.arange(mask.shape[0], device=mask.device)
    return rewards.index_put((rows, last), score, accumulate=True)


def per_turn_rewards(
    kl: Tensor, turn_rewards: Tensor, mask: Tensor, beta: float, *,
    truncated: Optional[Tensor] = None, truncation_penalty: float = 0.0, reward_clip: Optional[float] = None,
) -> Tuple[Tensor, Tensor]:
    """Dense PPO rewards [B, T] of multi-turn episodes rewarded turn by turn, and [B, T] the shaped
    rewards in them (the rewards less the KL penalty; summed over a row, its shaped score).

    kl, mask: as in ``per_token_rewards``; turn_rewards: [B, T] each turn's environment reward
    on that turn's last token, 0 elsewhere. Each placed reward is clipped to +-reward_clip if
    given; ``truncation_penalty`` is added on a truncated row's last valid token. Environment
    tokens (mask 0) carry nothing.
    """
    fn = "per_turn_rewards"
    check_shapes(fn, "mask", mask.shape, turn_rewards=turn_rewards)
    require(reward_clip is None or reward_clip > 0, f"{fn}: reward_clip must be > 0 or None, got {reward_clip}")
    placed = turn_rewards.to(kl.dtype)
    if reward_clip is not None:
        placed = placed.clamp(-reward_clip, reward_clip)
    placed = zero_pad(placed, mask)
    penalty = shaped_scores(torch.zeros(mask.shape[0], dtype=kl.dtype), truncated=truncated,
                            truncation_penalty=truncation_penalty, dtype=kl.dtype)
    last = _last_valid_index(fn, mask)
    shaped = placed.index_put((torch.arange(mask.shape[0], device=mask.device), last), penalty, accumulate=True)
    return zero_pad(-beta * kl, mask) + shaped, shaped


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95
) -> Tuple[Tensor, Tensor]:
    """Generalised advantage estimation over right-padded rows.

    rewards, values, mask: [B, T]. The value after the last valid token is 0 (the
    episode ends at EOS or truncation). Returns (advantages, returns), both [B, T],
    detached, 0 on padding; returns = advantages + values, before any whitening.

    Masked columns inside a row (a multi-turn transcript's environment tokens) are skipped,
    not ends: the recursion carries across them, so a turn's last token bootstraps from the
    value at the next turn's first token, and gamma and lam count valid tokens only. A row
    with gaps gets what it would get with those columns removed (0 there).
    """
    check_masked("gae", mask, rewards=rewards, values=values)
    # Zeroing padding makes V(after last valid token) = 0 and keeps garbage out.
    r = zero_pad(rewards.detach(), mask)
    v = zero_pad(values.detach(), mask)
    m = (mask != 0).to(v.dtype)
    next_value = torch.zeros_like(v[:, 0])
    running = torch.zeros_like(v[:, 0])
    advantages = [None] * v.shape[1]
    for t in reversed(range(v.shape[1])):
        valid = m[:, t] != 0
        delta = r[:, t] + gamma * next_value - v[:, t]
        step = delta + gamma * lam * running
        # Right padding comes first in this scan, while running and next_value are still 0.
        running = torch.where(valid, step, running)
        next_value = torch.where(valid, v[:, t], next_value)
        advantages[t] = torch.where(valid, step, torch.zeros_like(step))
    adv = torch.stack(advantages, dim=1)
    return adv, adv + v


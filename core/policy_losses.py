"""The policy losses besides PPO's clipped token ratio (core.ppo.policy_loss): GSPO and CISPO
(``ppo.policy_loss``). Pure tensor functions with PPO's signature and returns, so the learner
swaps them by name (learner/objectives/loss_terms.py); conventions as in core.masked.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from core.kl import LOG_RATIO_LIMIT
from core.masked import masked_mean, require, zero_pad
from core.ppo import TOKEN_MEAN, Aggregation, aggregate_loss, check_policy_inputs

Tensor = torch.Tensor
GSPO_AGG = "seq-mean-token-mean"
SEQ_MEAN_TOKEN_MEAN = Aggregation(mode=GSPO_AGG)


def _weighted(pg: Tensor, mask: Tensor, weights: Optional[Tensor]) -> Tensor:
    return pg if weights is None else pg * zero_pad(weights.detach(), mask)


def gspo_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
    clip_low: float = 3e-4, clip_high: Optional[float] = 4e-4, agg: Aggregation = SEQ_MEAN_TOKEN_MEAN,
    *, weights: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """GSPO (Zheng et al. 2025), in its token form (the paper's GSPO-token, verl's
    compute_policy_loss_gspo). All tensors [B, T]; returns (loss, clip_frac, approx_kl).

    Each row's sequence ratio s_i = exp(mean over its valid tokens of log pi - log pi_old) is
    clipped to [1 - clip_low, 1 + clip_high] (the paper's ranges are 3e-4 and 4e-4). Token t
    carries s_i,t = sg(s_i) * pi_t / sg(pi_t): equal to s_i in value, its gradient that of
    log pi_t, so every token of a row moves with its row's ratio (and its own advantage) in
    max(-A s_i,t, -A clip(s_i,t)). ``agg`` must be seq-mean-token-mean (GSPO's
    length normalisation; its global_seqs and horizon as in core.ppo.aggregate_loss).
    ``weights`` [B, T] multiply each token's term (the rollout correction). clip_frac: masked
    fraction of tokens whose clipped term is the larger (zero gradient); approx_kl: masked mean
    of 0.5 * (log pi - log pi_old)^2, token-level as core.ppo.policy_loss's. Metrics detached.
    """
    fn = "gspo_loss"
    clip_high = check_policy_inputs(fn, logprobs, old_logprobs, advantages, mask, clip_low, clip_high, weights)
    require(agg.mode == GSPO_AGG, f"{fn}: GSPO aggregates {GSPO_AGG}, got {agg.mode}")
    lp = zero_pad(logprobs, mask)  # padding garbage must not reach exp or the row mean
    log_ratio = zero_pad(lp - old_logprobs.detach(), mask)
    n = (mask != 0).sum(dim=1, keepdim=True).clamp_min(1).to(log_ratio.dtype)
    seq_log_ratio = log_ratio.sum(dim=1, keepdim=True) / n  # [B, 1]
    log_s = (lp - lp.detach() + seq_log_ratio.detach()).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    s = torch.exp(log_s)
    adv = zero_pad(advantages.detach(), mask)
    unclipped = -adv * s
    clipped = -adv * s.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = _weighted(torch.maximum(unclipped, clipped), mask, weights)
    loss = aggregate_loss(pg, mask, agg)
    with torch.no_grad():
        clip_frac = masked_mean((clipped > unclipped).to(pg.dtype), mask)
        approx_kl = masked_mean(0.5 * log_ratio**2, mask)
    return loss, clip_frac, approx_kl


def cispo_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
    clip_low: float = 0.2, clip_high: Optional[float] = None, agg: Aggregation = TOKEN_MEAN,
    *, weights: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """CISPO (MiniMax-M1, 2025; verl's compute_policy_loss_cispo). All tensors [B, T]; returns
    (loss, clip_frac, approx_kl).

    Per token -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) * A_t * log pi_t, r_t = pi / pi_old:
    the IS weight is clipped and stop-gradient, so every token keeps the gradient of its
    log pi (PPO's clip zeroes it instead). MiniMax-M1 aggregates token-mean (the default
    ``agg``); the loss's value holds log pi, so it is not comparable with PPO's. ``weights``
    [B, T] multiply each token's term. clip_frac: masked fraction of tokens whose weight was
    clipped; approx_kl: masked mean of 0.5 * (log pi - log pi_old)^2. Metrics detached.
    """
    fn = "cispo_loss"
    clip_high = check_policy_inputs(fn, logprobs, old_logprobs, advantages, mask, clip_low, clip_high, weights)
    lp = zero_pad(logprobs, mask)
    log_ratio = zero_pad(lp - old_logprobs.detach(), mask)
    ratio = torch.exp(log_ratio.detach().clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = _weighted(-weight * zero_pad(advantages.detach(), mask) * lp, mask, weights)
    loss = aggregate_loss(pg, mask, agg)
    with torch.no_grad():
        clip_frac = masked_mean((weight != ratio).to(pg.dtype), mask)
        approx_kl = masked_mean(0.5 * log_ratio**2, mask)
    return loss, clip_frac, approx_kl

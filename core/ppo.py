"""The PPO loss terms: aggregation, the clipped policy and value losses, the off-policy
importance weights, the KL-to-reference loss and the pretraining (PTX) loss. Pure tensor
functions, no model or distributed state; conventions as in core.masked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from core.choices import AGG_MODES, OFF_POLICY_MODES, correction_row
from core.corrections import Bounds, correct
from core.kl import LOG_RATIO_LIMIT, bounded_kl
from core.logprobs import logprobs_from_logits
from core.masked import check_masked, check_shapes, masked_mean, require, zero_pad

Tensor = torch.Tensor


@dataclass(frozen=True)
class Aggregation:
    """How a per-token loss [B, T] becomes a scalar: every loss term of one update takes the same.

    mode (``ppo.agg``):
      token-mean:               sum(loss * mask) / num_valid_tokens.
      seq-mean-token-mean:      mean over sequences of each sequence's token mean.
      seq-mean-token-sum-norm:  each sequence's token sum / horizon, then mean over
                                sequences. Dr. GRPO's horizon is a constant, the generation
                                budget (the learner passes max_new_tokens), so a row weighs
                                the same in any batch; the default T (the padded length) is
                                for callers without one.
    Sequences with no valid token are not counted. For data parallelism, set
    ``global_tokens`` (token-mean) or ``global_seqs`` (seq modes): the count over
    all ranks is then the divisor instead of the local one, so the per-rank losses
    SUM to the global-batch loss. Gradients must then be summed over ranks; if the
    framework averages them (DDP, DeepSpeed), scale the loss by the world size.
    Values irrelevant to ``mode`` are ignored so callers can always set both.
    """
    mode: str = "token-mean"
    global_tokens: Optional[float] = None
    global_seqs: Optional[float] = None
    horizon: Optional[int] = None


TOKEN_MEAN = Aggregation()


def aggregate_loss(loss_mat: Tensor, mask: Tensor, agg: Aggregation = TOKEN_MEAN) -> Tensor:
    """Reduce a per-token loss [B, T] to a scalar as ``agg`` says."""
    fn = "aggregate_loss"
    if agg.mode not in AGG_MODES:
        raise ValueError(f"{fn}: unknown mode {agg.mode!r}; valid: {', '.join(AGG_MODES)}")
    check_masked(fn, mask, loss_mat=loss_mat)
    for name in ("global_tokens", "global_seqs", "horizon"):
        val = getattr(agg, name)
        require(val is None or val > 0, f"{fn}: {name} must be > 0, got {val}")
    m = mask.to(loss_mat.dtype)
    weighted = zero_pad(loss_mat, mask) * m
    if agg.mode == "token-mean":
        return weighted.sum() / (agg.global_tokens if agg.global_tokens is not None else m.sum())

    seq_tokens = m.sum(dim=1)
    if agg.mode == "seq-mean-token-mean":
        per_seq = torch.where(seq_tokens != 0, weighted.sum(1) / seq_tokens.clamp_min(1e-12), 0.0)
    else:
        per_seq = weighted.sum(1) / (agg.horizon if agg.horizon is not None else mask.shape[1])
    n_seqs = agg.global_seqs if agg.global_seqs is not None else (seq_tokens != 0).sum()
    return per_seq.sum() / n_seqs


def kl_loss(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: str = "k3",
            agg: Aggregation = TOKEN_MEAN) -> Tuple[Tensor, Tensor]:
    """The KL to the reference as a loss term (``ppo.kl.placement: loss``); all [B, T].

    ``bounded_kl(logprobs, ref_logprobs, estimator)`` aggregated like the policy loss, with
    the gradient flowing through ``logprobs`` (the reference is frozen): per token,
    d k2 / d log pi = log pi - log ref and d k3 / d log pi = 1 - pi_ref / pi, within the
    clamps of core.kl (one token's k3 gradient at most K3_GRAD_BOUND, 12.61). The caller
    multiplies by beta. Returns (loss, masked mean of the estimate, detached).
    """
    fn = "kl_loss"
    check_masked(fn, mask, logprobs=logprobs, ref_logprobs=ref_logprobs)
    # Masked before the estimate: exp of padding garbage could overflow into inf * 0 = NaN.
    kl = bounded_kl(zero_pad(logprobs, mask), zero_pad(ref_logprobs.detach(), mask), estimator)
    loss = aggregate_loss(kl, mask, agg)
    with torch.no_grad():
        return loss, masked_mean(kl, mask)


def behaviour_weights(
    proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, mode: str = "tis", cap: float = 2.0,
    band: Optional[Tuple[float, float]] = None,
) -> Tuple[Tensor, Tensor]:
    """Per-token importance weights [B, T] that correct for the policy that SAMPLED the tokens.

    behaviour_logprobs: log pi_behaviour, recorded by the generator (possibly an older
    version, or the same weights scored by another engine); proximal_logprobs: log
    pi_prox, the learner's weights when the update starts (PPO's "old" log-probs, the
    anchor of the clipped ratio); with truncated sampling, of the set pi_prox itself would
    keep, -inf outside it (weight 0). ``mode`` is a rollout-correction preset
    (``ppo.off_policy``, core/corrections.py has each formula); with w = pi_prox / pi_behaviour:

      none:       1 on every valid token (the rollouts are treated as on-policy);
      tis:        min(w, cap): truncated importance sampling (Ionides 2008; as used
                  against sampler/learner mismatch by Yao et al. 2025). Every token
                  counts; a token the learner finds much likelier than the sampler
                  did counts at most ``cap`` times (bias for bounded variance);
      decoupled:  w where w <= cap, else 0: decoupled PPO (Hilton et al. 2022) with
                  AReaL's cap, which leaves such tokens out instead of truncating them;
      seq_tis, seq_mis, geo_rs, geo_rs_token_tis, icepop: the sequence-level and masking
                  presets; ``band`` (lower, upper) is their rejection band (None: the preset's
                  default, core.choices.CORRECTION_TABLE).

    Returns (weights, capped): weights detached, 0 on padding; capped [B, T] bool, True
    on valid tokens the preset truncated or rejected (for tis and decoupled: w > cap).
    """
    fn = "behaviour_weights"
    require(mode in OFF_POLICY_MODES, f"{fn}: unknown mode {mode!r}; valid: {', '.join(OFF_POLICY_MODES)}")
    require(cap >= 1 and math.isfinite(cap), f"{fn}: cap must be a finite number >= 1, got {cap}")
    lower, upper = band or correction_row(mode).band or (0.5, 2.0)
    out = correct(proximal_logprobs, behaviour_logprobs, mask, mode, Bounds(cap=cap, lower=lower, upper=upper))
    return out.weights, out.truncated | out.masked


def check_policy_inputs(fn: str, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                        clip_low: float, clip_high: Optional[float], weights: Optional[Tensor]) -> float:
    """Check a policy loss's [B, T] inputs and clip range (one-line errors naming ``fn``);
    returns clip_high, defaulting to clip_low."""
    check_masked(fn, mask, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    if weights is not None:
        check_shapes(fn, "mask", mask.shape, weights=weights)
    clip_high = clip_low if clip_high is None else clip_high
    require(0 < clip_low < 1 and clip_high > 0,
            f"{fn}: need 0 < clip_low < 1 and clip_high > 0, got clip_low={clip_low}, clip_high={clip_high}")
    return clip_high


def policy_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
    clip_low: float = 0.2, clip_high: Optional[float] = None, dual_clip: Optional[float] = None,
    agg: Aggregation = TOKEN_MEAN, *, weights: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Clipped PPO surrogate. All tensors [B, T]; returns (loss, clip_frac, approx_kl).

    ratio = exp(logprobs - old_logprobs), clipped to [1 - clip_low, 1 + clip_high]
    (clip_high defaults to clip_low; a larger clip_high is "clip-higher").
    ``dual_clip`` = c > 1 additionally caps the loss of negative-advantage tokens
    at -A * c (Ye et al. 2020), so a huge ratio cannot dominate the update.
    clip_frac: masked fraction of tokens where a clip bound (standard or dual) is
    active, i.e. their gradient is zero. approx_kl: masked mean of
    0.5 * (logprobs - old_logprobs)^2 (the k2 estimator). Metrics are detached.
    ``weights`` [B, T] (``behaviour_weights``) multiply each token's clipped term: the
    off-policy correction from the sampling policy to ``old_logprobs``' policy.
    """
    fn = "policy_loss"
    clip_high = check_policy_inputs(fn, logprobs, old_logprobs, advantages, mask, clip_low, clip_high, weights)
    require(dual_clip is None or dual_clip > 1, f"{fn}: dual_clip must be > 1, got {dual_clip}")

    # Masked before exp so padding garbage cannot overflow into inf * 0 = NaN; clamped so a
    # runaway token (log-ratio past ~88 overflows fp32) gives a large finite loss, not inf.
    log_ratio = zero_pad(logprobs - old_logprobs.detach(), mask)
    adv = zero_pad(advantages.detach(), mask)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    if dual_clip is not None:
        cap = -adv * dual_clip
        dual_active = (adv < 0) & (pg > cap)
        pg = torch.where(dual_active, cap, pg)
        is_clipped = is_clipped | dual_active
    if weights is not None:
        pg = pg * zero_pad(weights.detach(), mask)

    loss = aggregate_loss(pg, mask, agg)
    with torch.no_grad():
        clip_frac = masked_mean(is_clipped.to(pg.dtype), mask)
        approx_kl = masked_mean(0.5 * log_ratio**2, mask)
    return loss, clip_frac, approx_kl


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
    clip: Optional[float] = 0.2, agg: Aggregation = TOKEN_MEAN,
) -> Tuple[Tensor, Tensor]:
    """Clipped value loss 0.5 * max((V - R)^2, (clip(V, V_old +- clip) - R)^2).

    All tensors [B, T]. ``clip=None`` gives plain 0.5 * (V - R)^2. Returns
    (loss, vf_clip_frac) where vf_clip_frac (detached) is the masked fraction of
    tokens on which the clipped term is strictly larger (zero gradient there).
    """
    fn = "value_loss"
    check_masked(fn, mask, values=values, old_values=old_values, returns=returns)
    require(clip is None or clip > 0, f"{fn}: clip must be > 0 or None, got {clip}")
    v = zero_pad(values, mask)
    old = zero_pad(old_values.detach(), mask)
    ret = zero_pad(returns.detach(), mask)
    err = (v - ret) ** 2
    if clip is None:
        loss_mat, is_clipped = 0.5 * err, torch.zeros_like(err, dtype=torch.bool)
    else:
        v_clipped = old + (v - old).clamp(-clip, clip)
        err_clipped = (v_clipped - ret) ** 2
        loss_mat, is_clipped = 0.5 * torch.maximum(err, err_clipped), err_clipped > err
    loss = aggregate_loss(loss_mat, mask, agg)
    with torch.no_grad():
        clip_frac = masked_mean(is_clipped.to(err.dtype), mask)
    return loss, clip_frac


def ptx_loss(logits: Tensor, labels: Tensor, mask: Tensor) -> Tensor:
    """Pretraining (language-modelling) loss: masked token-mean cross-entropy.

    logits [B, T, V] are ALREADY aligned with labels [B, T]: logits[:, t] predicts
    labels[:, t]. The caller does the usual shift (logits[:, :-1] vs ids[:, 1:]).
    Labels at masked positions may be anything (e.g. -100); they are never read.
    """
    fn = "ptx_loss"
    check_masked(fn, mask, labels=labels)
    safe_labels = torch.where(mask != 0, labels.long(), 0)
    nll = -logprobs_from_logits(logits, safe_labels)
    return aggregate_loss(nll, mask)

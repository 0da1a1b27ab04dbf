"""Rollout corrections (``ppo.off_policy``): per-token weights [B, T] that correct the policy
gradient for the policy that SAMPLED the tokens. Pure tensor functions; conventions as in
core.masked (mask [B, T], 1 on a row's response tokens; a row is one sequence, and a multi-turn
row's context between its turns is masked, so it never counts).

Three policies meet in an update: pi_behaviour sampled the tokens (its log-probs are recorded by
the generator), pi_prox is the learner's weights when the update starts (PPO's pi_old) and
pi_theta is trained. With the token ratio w_t = pi_prox / pi_behaviour, each preset of
core.choices.CORRECTION_TABLE is one function here, named by its row:

  no_correction     (none):      1 on every valid token.
  token_tis         (tis):       min(w_t, cap).
  decoupled_drop    (decoupled): w_t where w_t <= cap, else 0.
  seq_tis           (seq_tis):   min(W, cap) on every token of the row, W = prod_t w_t.
  seq_mis           (seq_mis):   seq_tis's weight where lower <= W <= upper, else 0 (the row).
  geo_rs            (geo_rs):    1 where lower <= G <= upper, else 0 (the row), G = exp(mean_t log w_t).
  geo_rs_token_tis:              min(w_t, cap) where lower <= G <= upper, else 0 (the row).
  icepop            (icepop):    w_t where lower <= w_t <= upper, else 0 (the token).

Products and means run over the row's valid tokens, in log space. A rejected token keeps its
place in the aggregation's count (its weight is 0, as decoupled's dropped tokens), so the
other tokens' gradient does not grow when many are rejected. A token outside the set pi_prox
would sample from (truncated sampling: log pi_prox = -inf) has w_t = 0 exactly, so its row's W
and G are 0: Seq-TIS gives the row weight 0, and the bands reject it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from core.choices import CORRECTION_TABLE, correction_row
from core.kl import LOG_RATIO_LIMIT
from core.masked import check_masked, require, zero_pad

Tensor = torch.Tensor
NEG_INF = float("-inf")


@dataclass(frozen=True)
class Correction:
    """What a preset gives, each [B, T]: the weights (detached, 0 on padding and on rejected
    tokens), ``truncated`` (bool: valid tokens whose weight was cut down to the cap) and
    ``masked`` (bool: valid tokens the preset rejected, weight 0)."""
    weights: Tensor
    truncated: Tensor
    masked: Tensor


@dataclass(frozen=True)
class Bounds:
    """A preset's numbers: ``cap`` (``ppo.is_cap``) truncates or drops weights above it;
    ``lower``/``upper`` (``ppo.rs_lower``, ``ppo.rs_upper``) bound the ratio a band keeps."""
    cap: float = 2.0
    lower: float = 0.5
    upper: float = 2.0


def log_ratios(proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor) -> Tensor:
    """log w [B, T] = log pi_prox - log pi_behaviour (detached), 0 on padding, -inf where pi_prox is."""
    return zero_pad(proximal_logprobs.detach() - behaviour_logprobs.detach(), mask)


def _exp(log_w: Tensor) -> Tensor:
    """exp of [B, T] or [B, 1] log-weights, clamped to +-LOG_RATIO_LIMIT (as verl's safety bound);
    -inf (a token pi_prox never samples) gives exactly 0."""
    return torch.where(log_w == NEG_INF, 0.0, torch.exp(log_w.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)))


def _row_sum(log_w: Tensor, mask: Tensor) -> Tensor:
    """[B, 1]: log W, the sum of the row's valid log-weights (-inf when any is)."""
    return log_w.sum(dim=1, keepdim=True)  # padding is 0 (log_ratios)


def _row_mean(log_w: Tensor, mask: Tensor) -> Tensor:
    """[B, 1]: log G, the mean of the row's valid log-weights, each clamped to +-LOG_RATIO_LIMIT
    first as verl's seq_mean_k1 does (-inf when any is; 0 for a row with no valid token)."""
    n = (mask != 0).sum(dim=1, keepdim=True).clamp_min(1).to(log_w.dtype)
    mean = log_w.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).sum(dim=1, keepdim=True) / n
    return torch.where((log_w == NEG_INF).any(dim=1, keepdim=True), NEG_INF, mean)


def _inside(log_x: Tensor, b: Bounds) -> Tensor:
    """bool, log_x's shape: log(lower) <= log_x <= log(upper)."""
    return (log_x >= math.log(b.lower)) & (log_x <= math.log(b.upper))


def _result(weights: Tensor, mask: Tensor, truncated: Optional[Tensor] = None,
            masked: Optional[Tensor] = None) -> Correction:
    valid = mask != 0
    none = torch.zeros_like(valid)
    return Correction(weights=zero_pad(weights.expand_as(mask), mask),
                      truncated=valid & truncated.expand_as(mask) if truncated is not None else none,
                      masked=valid & masked.expand_as(mask) if masked is not None else none)


def no_correction(log_w: Tensor, mask: Tensor, b: Bounds) -> Correction:
    """none: weight 1 on every valid token of [B, T]."""
    return _result((mask != 0).to(log_w.dtype), mask)


def token_tis(log_w: Tensor, mask: Tensor, b: Bounds) -> Correction:
    """tis (verl's Token-TIS): min(w_t, cap), [B, T]."""
    w = _exp(log_w)
    return _result(w.clamp_max(b.cap), mask, truncated=w > b.cap)


def decoupled_drop(log_w: Tensor, mask: Tensor, b: Bounds) -> Correction:
    """decoupled (decoupled PPO with AReaL's cap): w_t where w_t <= cap, else 0, [B, T]."""
    w = _exp(log_w)
    over = w > b.cap
    return _result(torch.where(over, 0.0, w), mask, masked=over)


def seq_tis(log_w: Tensor, mask: Tensor, b: Bounds) -> Correction:
    """seq_tis (verl's Seq-TIS): min(W, cap) on every token of the row, W = prod_t w_t, [B, T]."""
    w_seq = _exp(_row_sum(log_w, mask))
    return _result(w_seq.clamp_max(b.cap), mask, truncated=w_seq > b.cap)


def seq_mis(log_w: Tensor, mask: Tensor, b: Bounds) -> Correction:
    """seq_mis (verl's Seq-MIS, decoupled_seq_is_rs): Seq-TIS's min(W, cap) where
    lower <= W <= upper, else 0 on the whole row, [B, T]."""
    log_seq = _row_sum(log_w, mask)
    w_seq, keep = _exp(log_seq), _inside(log_seq, b)
    return _result(torch.where(keep, w_seq.clamp_max(b.cap), 0.0), mask, truncated=keep & (w_seq > b.cap),
                   masked=~keep)


def geo_rs(log_w: Tensor, mask: Tensor, b: Bounds) -> Correction:
    """geo_rs (verl's Geo-RS, seq_mean_k1): 1 where the row's geometric-mean ratio
    G = exp(mean_t log w_t) is in [lower, upper], else 0 on the whole row, [B, T]."""
    keep = _inside(_row_mean(log_w, mask), b)
    return _result(keep.to(log_w.dtype), mask, masked=~keep)


def geo_rs_token_tis(log_w: Tensor, mask: Tensor, b: Bounds) -> Correction:
    """geo_rs_token_tis (verl's decoupled_geo_rs_token_tis): Token-TIS's min(w_t, cap) on the rows
    Geo-RS keeps, 0 on the others, [B, T]."""
    keep = _inside(_row_mean(log_w, mask), b)
    w = _exp(log_w)
    return _result(torch.where(keep, w.clamp_max(b.cap), 0.0), mask, truncated=keep & (w > b.cap), masked=~keep)


def icepop(log_w: Tensor, mask: Tensor, b: Bounds) -> Correction:
    """icepop (IcePop's two-sided token mask): w_t where lower <= w_t <= upper, else 0, [B, T];
    no truncation."""
    keep = _inside(log_w, b)
    return _result(torch.where(keep, _exp(log_w), 0.0), mask, masked=~keep)


# The presets' functions by name (the row's ``function``); tests check every row has one.
PRESETS: dict[str, Callable[[Tensor, Tensor, Bounds], Correction]] = {
    row.name: globals()[row.function] for row in CORRECTION_TABLE}


def correct(proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, preset: str = "tis",
            bounds: Bounds = Bounds()) -> Correction:
    """The ``preset``'s Correction for log-probs [B, T] (see the module's docstring)."""
    fn = "correct"
    row = correction_row(preset)
    require(bounds.cap >= 1 and math.isfinite(bounds.cap), f"{fn}: cap must be a finite number >= 1, got {bounds.cap}")
    require(0 < bounds.lower < bounds.upper and math.isfinite(bounds.upper),
            f"{fn}: need 0 < lower < upper, got lower={bounds.lower}, upper={bounds.upper}")
    check_masked(fn, mask, nonempty=False, proximal_logprobs=proximal_logprobs, behaviour_logprobs=behaviour_logprobs)
    return PRESETS[row.name](log_ratios(proximal_logprobs, behaviour_logprobs, mask), mask, bounds)

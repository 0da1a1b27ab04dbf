"""PPO-for-RLHF numerics: pure tensor functions, no model or distributed state.

Conventions used throughout (see docs/design.md, "Numeric conventions"):
  * ``mask`` is ``[B, T]`` with 1.0 on valid response tokens and 0 on padding;
    sequences are right-padded.
  * Masked functions never read padding positions: they are replaced with 0 via
    ``torch.where`` (not multiplication, so NaN/inf garbage cannot leak).
  * Shape mismatches and masks with no valid token raise ``ValueError``
    instead of silently broadcasting or returning NaN.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Tuple

import torch

from core import sampling
from core.choices import AGG_MODES, KL_ESTIMATORS, KL_PLACEMENTS, OFF_POLICY_MODES, kl_placement_error  # noqa: F401

Tensor = torch.Tensor



# --------------------------------------------------------------------------- validation


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_shapes(fn: str, ref_name: str, ref_shape: Sequence[int], **tensors: Tensor) -> None:
    """Every tensor in ``tensors`` must have exactly ``ref_shape`` (no broadcasting)."""
    ref_shape = tuple(ref_shape)
    for name, t in tensors.items():
        if tuple(t.shape) != ref_shape:
            raise ValueError(
                f"{fn}: {name} shape {tuple(t.shape)} does not match {ref_name} shape {ref_shape}"
            )


def _check_masked(fn: str, mask: Tensor, *, two_d: bool = True, nonempty: bool = True,
                  **tensors: Tensor) -> None:
    """Shared checks for masked functions: shapes equal the mask's, mask non-empty
    (``nonempty=False``: the caller checks the count over the global batch instead)."""
    _require(not two_d or mask.dim() == 2, f"{fn}: mask must be 2-D [B, T], got shape {tuple(mask.shape)}")
    _check_shapes(fn, "mask", mask.shape, **tensors)
    # One host sync; worth it to turn a silent NaN into a loud error.
    _require(not nonempty or bool((mask != 0).any()), f"{fn}: mask has no valid tokens")


def _check_temperature(fn: str, temperature: float) -> None:
    _require(temperature > 0 and math.isfinite(temperature),
             f"{fn}: temperature must be a finite number > 0, got {temperature}")


def _zero_pad(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask != 0, x, torch.zeros((), dtype=x.dtype, device=x.device))


# --------------------------------------------------------------------------- masked statistics


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of ``x`` over entries where ``mask`` != 0 (mask values act as weights).

    ``x`` and ``mask`` have the same shape (any rank). With ``dim=None`` returns a
    scalar; otherwise reduces over ``dim`` and slices with no valid entry give 0
    (they carry no information; callers that average them further should skip them).
    """
    _check_masked("masked_mean", mask, two_d=False, x=x)
    m = mask.to(x.dtype)
    weighted = _zero_pad(x, mask) * m
    if dim is None:
        return weighted.sum() / m.sum()
    count = m.sum(dim)
    return torch.where(count != 0, weighted.sum(dim) / count.clamp_min(1e-12), 0.0)


def masked_var(x: Tensor, mask: Tensor) -> Tensor:
    """Biased (population) variance of the valid entries of ``x``, as a scalar."""
    _check_masked("masked_var", mask, two_d=False, x=x)
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask)


def local_sums(values: list) -> list:
    """The default ``reduce``: one process holds the whole batch, so its sums are the global ones."""
    return list(values)


def _masked_moments(fn: str, xs: Sequence[Tensor], mask: Tensor, reduce) -> Tuple[list, list]:
    """(means, biased variances) of each x in ``xs`` over the valid entries of ``mask``.

    ``reduce`` turns this process's partial sums into sums over the whole batch; it is
    called twice (sums and count, then squared deviations from the global means), so the
    variance is the two-pass one, as precise as ``masked_var``.
    """
    m = mask.to(xs[0].dtype)
    *totals, count = reduce([(_zero_pad(x, mask) * m).sum() for x in xs] + [m.sum()])
    _require(bool(count != 0), f"{fn}: mask has no valid tokens")
    means = [total / count for total in totals]
    squares = reduce([(_zero_pad((x - mu) ** 2, mask) * m).sum() for x, mu in zip(xs, means)])
    return means, [sq / count for sq in squares]


def whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8, *,
           reduce: Callable[[list], list] = local_sums) -> Tensor:
    """Normalise ``x`` [B, T] (any shape equal to ``mask``'s) to unit variance with
    statistics of valid entries only; returns the same shape, 0 on padding.

    ``shift_mean=False`` adds the mean back, i.e. only rescales (used for rewards, where
    the sign carries meaning). Statistics cover the whole batch: by default the local
    one; when the batch is split over processes, ``reduce`` takes a list of local
    scalars (0-d tensors) and returns their sums over all processes, in order (an
    all-reduce); a process may then hold no valid entry as long as some process does.
    """
    fn = "whiten"
    _check_masked(fn, mask, two_d=False, nonempty=False, x=x)
    (mean,), (var,) = _masked_moments(fn, [x], mask, reduce)
    var = torch.as_tensor(var, dtype=x.dtype, device=x.device)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return _zero_pad(out, mask)


# --------------------------------------------------------------------------- logits -> logprobs


def _tempered(logits: Tensor, temperature: float) -> Tensor:
    # Half-precision logsumexp over a large vocabulary loses too much; upcast those only.
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return logits / temperature if temperature != 1.0 else logits


def logprobs_from_logits(logits: Tensor, tokens: Tensor, temperature: float = 1.0, *,
                         top_k: int = 0, top_p: float = 1.0, kept_ids: Optional[Tensor] = None) -> Tensor:
    """Log-probability of ``tokens`` [B, T] under ``softmax(logits / temperature)``.

    ``logits`` is [B, T, V] and is aligned with ``tokens`` (logits[:, t] scores
    tokens[:, t]; the caller does any shift). The temperature must be the sampling one so
    that the ratio matches the behaviour policy. Truncated sampling (core.sampling):
    ``kept_ids`` [B, T, K] (the sampler's kept set, -1 = padding) renormalises over that
    set; without it, ``top_k``/``top_p`` truncate by these logits' own kept set, and a token
    outside it gets -inf. Returns [B, T] (float32 for half-precision logits). Padding
    positions are computed like any other; mask them downstream.
    """
    fn = "logprobs_from_logits"
    scaled = _scaled(fn, logits, temperature, top_k, top_p)
    if logits.dim() != tokens.dim() + 1:
        raise ValueError(f"{fn}: logits shape {tuple(logits.shape)} must be tokens shape "
                         f"{tuple(tokens.shape)} plus a vocabulary dimension")
    _check_shapes(fn, "logits batch", logits.shape[:-1], tokens=tokens)
    if kept_ids is not None:
        return sampling.kept_logprobs(scaled, tokens, kept_ids)
    if sampling.is_truncated(top_k, top_p):
        return sampling.truncated_logprobs(scaled, tokens, top_k, top_p)
    # gather - logsumexp avoids a second [B, T, V] tensor for the full log-softmax.
    picked = scaled.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0, *, top_k: int = 0,
                        top_p: float = 1.0, kept_ids: Optional[Tensor] = None,
                        tokens: Optional[Tensor] = None) -> Tensor:
    """Entropy [B, T] of ``softmax(logits / temperature)`` for logits [B, T, V]: over the
    sampler's kept set ``kept_ids`` [B, T, K] (with the sampled ``tokens`` [B, T]) when given,
    else truncated by ``top_k``/``top_p`` as these logits' own sampler would."""
    scaled = _scaled("entropy_from_logits", logits, temperature, top_k, top_p)
    if kept_ids is not None:
        _require(tokens is not None, "entropy_from_logits: kept_ids needs the sampled tokens")
        return sampling.kept_entropy(scaled, tokens, kept_ids)
    if sampling.is_truncated(top_k, top_p):
        return sampling.truncated_entropy(scaled, top_k, top_p)
    probs = torch.softmax(scaled, dim=-1)
    # H = logsumexp(z) - sum(p * z); avoids log(p) underflow for tiny probabilities.
    return torch.logsumexp(scaled, dim=-1) - (probs * scaled).sum(-1)


def _scaled(fn: str, logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    _check_temperature(fn, temperature)
    sampling.check_truncation(fn, top_k, top_p)
    return _tempered(logits, temperature)


# --------------------------------------------------------------------------- KL and rewards


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token estimate [B, T] of KL(pi || ref) from samples drawn from pi.

    With r = logprobs - ref_logprobs (Schulman, "Approximating KL divergence"):
      k1 = r                     unbiased, can be negative, high variance
      k2 = 0.5 * r**2            biased, >= 0, low variance
      k3 = exp(-r) - 1 + r       unbiased, >= 0
    """
    fn = "kl_estimate"
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"{fn}: unknown estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
    _check_shapes(fn, "ref_logprobs", ref_logprobs.shape, logprobs=logprobs)
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    # expm1 keeps precision for small r; the clamp removes rounding below the true
    # minimum of 0 (k3 is non-negative mathematically).
    return (torch.expm1(-log_ratio) + log_ratio).clamp_min(0.0)


def kl_loss(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: str = "k3",
            agg: str = "token-mean", *, global_tokens: Optional[float] = None,
            global_seqs: Optional[float] = None, horizon: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """The KL to the reference as a loss term (``ppo.kl.placement: loss``); all [B, T].

    ``kl_estimate(logprobs, ref_logprobs, estimator)`` aggregated like the policy loss, with
    the gradient flowing through ``logprobs`` (the reference is frozen): per token,
    d k2 / d log pi = log pi - log ref and d k3 / d log pi = 1 - pi_ref / pi. The caller
    multiplies by beta. Returns (loss, masked mean of the estimate, detached).
    """
    fn = "kl_loss"
    _check_masked(fn, mask, logprobs=logprobs, ref_logprobs=ref_logprobs)
    # Masked before the estimate: exp of padding garbage could overflow into inf * 0 = NaN.
    kl = kl_estimate(_zero_pad(logprobs, mask), _zero_pad(ref_logprobs.detach(), mask), estimator)
    loss = aggregate_loss(kl, mask, agg, global_tokens, global_seqs, horizon)
    with torch.no_grad():
        return loss, masked_mean(kl, mask)


def _last_valid_index(fn: str, mask: Tensor) -> Tensor:
    valid = mask != 0
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(valid, positions, -1).amax(dim=1)
    if bool((last < 0).any()):
        rows = (last < 0).nonzero().flatten().tolist()
        raise ValueError(f"{fn}: rows {rows} of mask have no valid tokens")
    return last


def per_token_rewards(
    kl: Tensor, scores: Tensor, mask: Tensor, beta: float, *,
    truncated: Optional[Tensor] = None, truncation_penalty: float = 0.0, reward_clip: Optional[float] = None,
) -> Tensor:
    """Dense PPO rewards [B, T]: ``-beta * kl`` per valid token, score on the last one.

    kl: [B, T] per-token KL estimate; scores: [B] reward-model score per sequence;
    mask: [B, T]. The score is placed only on each row's last valid token (the EOS,
    or the final token of a truncated response), never broadcast. If ``reward_clip``
    is given the score is first clipped to [-reward_clip, reward_clip]; then rows
    with ``truncated`` [B] (bool, cut at max length without EOS) get
    ``truncation_penalty`` ADDED (so a penalty is normally negative, e.g. -1.0);
    the penalty is not clipped. Padding is 0. Gradients are not stopped: call
    under ``torch.no_grad()``.
    """
    fn = "per_token_rewards"
    _require(mask.dim() == 2, f"{fn}: mask must be 2-D [B, T], got shape {tuple(mask.shape)}")
    _check_shapes(fn, "mask", mask.shape, kl=kl)
    _check_shapes(fn, "mask rows", mask.shape[:1], scores=scores)
    if truncated is not None:
        _check_shapes(fn, "mask rows", mask.shape[:1], truncated=truncated)
    _require(beta >= 0, f"{fn}: beta must be >= 0, got {beta}")
    _require(reward_clip is None or reward_clip > 0,
             f"{fn}: reward_clip must be > 0 or None, got {reward_clip}")
    last = _last_valid_index(fn, mask)

    score = scores.to(kl.dtype)
    if reward_clip is not None:
        score = score.clamp(-reward_clip, reward_clip)
    if truncated is not None:
        score = score + truncated.to(torch.bool).to(score.dtype) * truncation_penalty
    rewards = _zero_pad(-beta * kl, mask)
    rows = torch.arange(mask.shape[0], device=mask.device)
    return rewards.index_put((rows, last), score, accumulate=True)


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95
) -> Tuple[Tensor, Tensor]:
    """Generalised advantage estimation over right-padded rows.

    rewards, values, mask: [B, T]. The value after the last valid token is 0 (the
    episode ends at EOS or truncation). Returns (advantages, returns), both [B, T],
    detached, 0 on padding; returns = advantages + values, before any whitening.
    """
    _check_masked("gae", mask, rewards=rewards, values=values)
    # Zeroing padding makes V(after last valid token) = 0 and keeps garbage out.
    r = _zero_pad(rewards.detach(), mask)
    v = _zero_pad(values.detach(), mask)
    m = (mask != 0).to(v.dtype)
    next_value = torch.zeros_like(v[:, 0])
    running = torch.zeros_like(v[:, 0])
    advantages = [None] * v.shape[1]
    for t in reversed(range(v.shape[1])):
        delta = r[:, t] + gamma * next_value - v[:, t]
        # Redundant for right padding (zeros stay zero); guards masks with interior gaps.
        running = (delta + gamma * lam * running) * m[:, t]
        advantages[t] = running
        next_value = v[:, t]
    adv = torch.stack(advantages, dim=1)
    return adv, adv + v


# --------------------------------------------------------------------------- losses


def aggregate_loss(
    loss_mat: Tensor, mask: Tensor, mode: str = "token-mean",
    global_tokens: Optional[float] = None, global_seqs: Optional[float] = None, horizon: Optional[int] = None,
) -> Tensor:
    """Reduce a per-token loss [B, T] to a scalar.

    token-mean:               sum(loss * mask) / num_valid_tokens.
    seq-mean-token-mean:      mean over sequences of each sequence's token mean.
    seq-mean-token-sum-norm:  each sequence's token sum / horizon (default T, the
                              padded length, as in Dr. GRPO), then mean over sequences.
    Sequences with no valid token are not counted. For data parallelism, pass
    ``global_tokens`` (token-mean) or ``global_seqs`` (seq modes): the count over
    all ranks is then the divisor instead of the local one, so the per-rank losses
    SUM to the global-batch loss. Gradients must then be summed over ranks; if the
    framework averages them (DDP, DeepSpeed), scale the loss by the world size.
    Arguments irrelevant to ``mode`` are ignored so callers can always pass both.
    """
    fn = "aggregate_loss"
    if mode not in AGG_MODES:
        raise ValueError(f"{fn}: unknown mode {mode!r}; valid: {', '.join(AGG_MODES)}")
    _check_masked(fn, mask, loss_mat=loss_mat)
    for name, val in (("global_tokens", global_tokens), ("global_seqs", global_seqs), ("horizon", horizon)):
        _require(val is None or val > 0, f"{fn}: {name} must be > 0, got {val}")
    m = mask.to(loss_mat.dtype)
    weighted = _zero_pad(loss_mat, mask) * m
    if mode == "token-mean":
        return weighted.sum() / (global_tokens if global_tokens is not None else m.sum())

    seq_tokens = m.sum(dim=1)
    if mode == "seq-mean-token-mean":
        per_seq = torch.where(seq_tokens != 0, weighted.sum(1) / seq_tokens.clamp_min(1e-12), 0.0)
    else:
        per_seq = weighted.sum(1) / (horizon if horizon is not None else mask.shape[1])
    n_seqs = global_seqs if global_seqs is not None else (seq_tokens != 0).sum()
    return per_seq.sum() / n_seqs


LOG_RATIO_LIMIT = 20.0  # |log pi/pi_old| beyond this is clamped before exp (e^20 ~ 4.9e8)


def behaviour_weights(
    proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, mode: str = "tis", cap: float = 2.0,
) -> Tuple[Tensor, Tensor]:
    """Per-token importance weights [B, T] that correct for the policy that SAMPLED the tokens.

    behaviour_logprobs: log pi_behaviour, recorded by the generator (possibly an older
    version, or the same weights scored by another engine); proximal_logprobs: log
    pi_prox, the learner's weights when the update starts (PPO's "old" log-probs, the
    anchor of the clipped ratio); with truncated sampling, of the set pi_prox itself would
    keep, -inf outside it (weight 0). With w = pi_prox / pi_behaviour:

      none:       1 on every valid token (the rollouts are treated as on-policy);
      tis:        min(w, cap): truncated importance sampling (Ionides 2008; as used
                  against sampler/learner mismatch by Yao et al. 2025). Every token
                  counts; a token the learner finds much likelier than the sampler
                  did counts at most ``cap`` times (bias for bounded variance);
      decoupled:  w where w <= cap, else 0: decoupled PPO (Hilton et al. 2022) with
                  AReaL's cap, which leaves such tokens out instead of truncating them.

    Returns (weights, capped): weights detached, 0 on padding; capped [B, T] bool, True
    on valid tokens with w > cap (truncated by tis, dropped by decoupled; False for none).
    """
    fn = "behaviour_weights"
    _require(mode in OFF_POLICY_MODES, f"{fn}: unknown mode {mode!r}; valid: {', '.join(OFF_POLICY_MODES)}")
    _require(cap >= 1 and math.isfinite(cap), f"{fn}: cap must be a finite number >= 1, got {cap}")
    _check_masked(fn, mask, nonempty=False, proximal_logprobs=proximal_logprobs,
                  behaviour_logprobs=behaviour_logprobs)
    valid = mask != 0
    log_w = _zero_pad(proximal_logprobs.detach() - behaviour_logprobs.detach(), mask)
    # -inf: the token is outside the set the proximal policy would sample from (truncated
    # sampling, core.sampling), so it has no probability there: weight exactly 0.
    w = torch.where(log_w == float("-inf"), 0.0, torch.exp(log_w.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)))
    if mode == "none":
        return valid.to(w.dtype), torch.zeros_like(valid)
    capped = valid & (w > cap)
    kept = w.clamp_max(cap) if mode == "tis" else torch.where(capped, 0.0, w)
    return _zero_pad(kept, mask), capped


def policy_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
    clip_low: float = 0.2, clip_high: Optional[float] = None, dual_clip: Optional[float] = None,
    agg: str = "token-mean", *, weights: Optional[Tensor] = None,
    global_tokens: Optional[float] = None, global_seqs: Optional[float] = None, horizon: Optional[int] = None,
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
    _check_masked(fn, mask, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    if weights is not None:
        _check_shapes(fn, "mask", mask.shape, weights=weights)
    clip_high = clip_low if clip_high is None else clip_high
    _require(0 < clip_low < 1 and clip_high > 0,
             f"{fn}: need 0 < clip_low < 1 and clip_high > 0, got clip_low={clip_low}, clip_high={clip_high}")
    _require(dual_clip is None or dual_clip > 1, f"{fn}: dual_clip must be > 1, got {dual_clip}")

    # Masked before exp so padding garbage cannot overflow into inf * 0 = NaN; clamped so a
    # runaway token (log-ratio past ~88 overflows fp32) gives a large finite loss, not inf.
    log_ratio = _zero_pad(logprobs - old_logprobs.detach(), mask)
    adv = _zero_pad(advantages.detach(), mask)
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
        pg = pg * _zero_pad(weights.detach(), mask)

    loss = aggregate_loss(pg, mask, agg, global_tokens, global_seqs, horizon)
    with torch.no_grad():
        clip_frac = masked_mean(is_clipped.to(pg.dtype), mask)
        approx_kl = masked_mean(0.5 * log_ratio**2, mask)
    return loss, clip_frac, approx_kl


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
    clip: Optional[float] = 0.2, agg: str = "token-mean", *,
    global_tokens: Optional[float] = None, global_seqs: Optional[float] = None, horizon: Optional[int] = None,
) -> Tuple[Tensor, Tensor]:
    """Clipped value loss 0.5 * max((V - R)^2, (clip(V, V_old +- clip) - R)^2).

    All tensors [B, T]. ``clip=None`` gives plain 0.5 * (V - R)^2. Returns
    (loss, vf_clip_frac) where vf_clip_frac (detached) is the masked fraction of
    tokens on which the clipped term is strictly larger (zero gradient there).
    """
    fn = "value_loss"
    _check_masked(fn, mask, values=values, old_values=old_values, returns=returns)
    _require(clip is None or clip > 0, f"{fn}: clip must be > 0 or None, got {clip}")
    v = _zero_pad(values, mask)
    old = _zero_pad(old_values.detach(), mask)
    ret = _zero_pad(returns.detach(), mask)
    err = (v - ret) ** 2
    if clip is None:
        loss_mat, is_clipped = 0.5 * err, torch.zeros_like(err, dtype=torch.bool)
    else:
        v_clipped = old + (v - old).clamp(-clip, clip)
        err_clipped = (v_clipped - ret) ** 2
        loss_mat, is_clipped = 0.5 * torch.maximum(err, err_clipped), err_clipped > err
    loss = aggregate_loss(loss_mat, mask, agg, global_tokens, global_seqs, horizon)
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
    _check_masked(fn, mask, labels=labels)
    safe_labels = torch.where(mask != 0, labels.long(), 0)
    nll = -logprobs_from_logits(logits, safe_labels)
    return aggregate_loss(nll, mask, "token-mean")


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor, *,
                       reduce: Callable[[list], list] = local_sums) -> Tensor:
    """1 - Var(R - V) / Var(R) over valid tokens, as a detached 0-d tensor.

    values, returns, mask: [B, T]. 1 is a perfect critic, 0 no better than a constant,
    negative worse. If the returns have zero variance the ratio is undefined and NaN is
    returned. ``reduce``: as in ``whiten``, for a batch split over processes.
    """
    fn = "explained_variance"
    _check_masked(fn, mask, nonempty=False, values=values, returns=returns)
    with torch.no_grad():
        _, (var_r, var_resid) = _masked_moments(fn, [returns, returns - values], mask, reduce)
        var_r = torch.as_tensor(var_r, dtype=returns.dtype, device=returns.device)
        if bool(var_r == 0):
            return torch.full_like(var_r, float("nan"))
        return 1.0 - var_resid / var_r


# --------------------------------------------------------------------------- KL controllers


class FixedKLController:
    """Constant KL coefficient; ``update`` is a no-op kept for interface parity."""

    def __init__(self, beta: float):
        _require(beta >= 0 and math.isfinite(beta),
                 f"FixedKLController: beta must be finite and >= 0, got {beta}")
        self.value = float(beta)

    def update(self, current_kl: float, n_steps: int) -> None:
        return None


class AdaptiveKLController:
    """Proportional KL controller of Ziegler et al. 2019.

    error = clip(current_kl / target - 1, -0.2, 0.2);
    beta <- beta * (1 + error * n_steps / horizon).
    The clipping bounds how fast beta moves when the KL estimate is noisy.
    """

    def __init__(self, init_beta: float, target: float, horizon: float):
        name = "AdaptiveKLController"
        _require(init_beta >= 0 and math.isfinite(init_beta),
                 f"{name}: init_beta must be finite and >= 0, got {init_beta}")
        _require(target > 0, f"{name}: target must be > 0, got {target}")
        _require(horizon > 0, f"{name}: horizon must be > 0, got {horizon}")
        self.value = float(init_beta)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        current_kl = float(current_kl)
        fn = "AdaptiveKLController.update"
        _require(math.isfinite(current_kl), f"{fn}: current_kl must be finite, got {current_kl}")
        _require(n_steps >= 0, f"{fn}: n_steps must be >= 0, got {n_steps}")
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

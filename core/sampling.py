"""The sampled distribution under top-k / top-p truncation, as every side must score it.

The generator samples from the truncated distribution: at each position the sampler keeps
a set S of tokens (from the behaviour policy's own logits) and renormalises over it; vLLM
reports the log-probs of that distribution (``logprobs_mode="processed_logprobs"``). Every
other quantity is taken over the same S, which the generator records per token
(``Rollout.kept_ids``):

* the reference scores pi_ref renormalised over S, so the per-token k1 penalty
  log pi_b^S(y) - log pi_ref^S(y) has expectation KL(pi_b^S || pi_ref^S) >= 0 under the
  sampler, 0 only when the two agree on S (``kept_logprobs``);
* the learner's PPO ratio and entropy are of pi_theta renormalised over S;
* the off-policy weight is pi_prox^T(y) / pi_b^S(y), where T is the set the proximal policy
  itself would keep (``truncated_logprobs``): a token outside T has weight 0, and the weights'
  mean under the sampler is pi_prox^T(S) <= 1.

Which tokens a policy keeps follows vLLM's PyTorch sampler (``apply_top_k_top_p_pytorch``):
top-k keeps every logit >= the k-th largest (ties included); top-p sorts the logits
ascending, takes the softmax of the top-k survivors and its running sum, and drops the
tokens whose running sum is <= 1 - p, always keeping the most likely one (of tokens tied
at that edge, sorting decides which drop: the same sort of the same logits as vLLM's).
"""
from __future__ import annotations

import numpy as np
import torch

Tensor = torch.Tensor


def check_truncation(fn: str, top_k: int, top_p: float) -> None:
    if not (isinstance(top_k, int) and top_k >= 0):
        raise ValueError(f"{fn}: top_k must be an int >= 0 (0 disables it), got {top_k!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"{fn}: top_p must be in (0, 1] (1 disables it), got {top_p!r}")


def is_truncated(top_k: int, top_p: float) -> bool:
    return top_k > 0 or top_p < 1


def kept_tokens(scaled: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """bool [..., V]: the tokens the sampler may draw from tempered logits ``scaled`` [..., V].

    float32 or wider logits give vLLM's own decisions (it truncates in float32).
    """
    check_truncation("kept_tokens", top_k, top_p)
    keep = torch.ones_like(scaled, dtype=torch.bool)
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        kth_largest = scaled.topk(top_k, dim=-1).values[..., -1:]
        keep = scaled >= kth_largest
    if top_p < 1:
        # vLLM's order of operations: sort the logits before the top-k mask, not after, so
        # that tokens tied at the nucleus' edge sort alike and the same ones of them drop.
        ascending, order = scaled.sort(dim=-1)
        if 0 < top_k < vocab:
            kth = ascending[..., vocab - top_k:vocab - top_k + 1]
            ascending = ascending.masked_fill(ascending < kth, float("-inf"))
        running = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = running <= 1 - top_p
        drop[..., -1] = False  # the most likely token always stays
        keep = keep & ~torch.zeros_like(drop).scatter(-1, order, drop)
    return keep


def truncated_logprobs(scaled: Tensor, tokens: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Log-prob [B, T] of ``tokens`` [B, T] under the truncated softmax of ``scaled`` [B, T, V],
    the kept set being the one these logits themselves give: -inf for a token outside it.

    What a policy would assign if it sampled (the proximal policy in the off-policy weight).
    """
    idx = tokens.long().unsqueeze(-1)
    keep = kept_tokens(scaled.detach(), top_k, top_p)
    masked = scaled.masked_fill(~keep, float("-inf"))
    return masked.gather(-1, idx).squeeze(-1) - torch.logsumexp(masked, dim=-1)


def truncated_entropy(scaled: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Entropy [B, T] of the truncated softmax of ``scaled`` [B, T, V]."""
    keep = kept_tokens(scaled.detach(), top_k, top_p)
    masked = scaled.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(masked, dim=-1)
    # p * z is 0 * -inf = NaN on dropped tokens: take only the kept ones.
    expected = torch.where(keep, probs * scaled, torch.zeros((), dtype=scaled.dtype)).sum(-1)
    return torch.logsumexp(masked, dim=-1) - expected


def _on_kept(scaled: Tensor, tokens: Tensor, kept_ids: Tensor) -> Tensor:
    """[B, T, K + 1] the logits of the kept set, -inf on padding ids (< 0) and on a repeat of
    the token; the last column is the token's own logit.

    The token is always in its sampler's set; carrying it separately keeps padding positions
    (no kept id at all) finite, so no NaN reaches a masked gradient.
    """
    if kept_ids.shape[:-1] != tokens.shape:
        raise ValueError(f"kept_ids shape {tuple(kept_ids.shape)} must be tokens shape "
                         f"{tuple(tokens.shape)} plus a kept-set dimension")
    idx = tokens.long().unsqueeze(-1)
    kept_ids = kept_ids.long()
    drop = (kept_ids < 0) | (kept_ids == idx)
    on_set = scaled.gather(-1, kept_ids.clamp_min(0)).masked_fill(drop, float("-inf"))
    return torch.cat([on_set, scaled.gather(-1, idx)], dim=-1)


def kept_logprobs(scaled: Tensor, tokens: Tensor, kept_ids: Tensor) -> Tensor:
    """Log-prob [B, T] of ``tokens`` [B, T] under the softmax of ``scaled`` [B, T, V]
    renormalised over the sampler's kept set ``kept_ids`` [B, T, K] (token ids, -1 = padding).

    Differentiable in ``scaled``; only the K kept logits are read, never a [B, T, V] mask.
    """
    z = _on_kept(scaled, tokens, kept_ids)
    return z[..., -1] - torch.logsumexp(z, dim=-1)


def kept_entropy(scaled: Tensor, tokens: Tensor, kept_ids: Tensor) -> Tensor:
    """Entropy [B, T] of the softmax of ``scaled`` [B, T, V] renormalised over ``kept_ids``."""
    z = _on_kept(scaled, tokens, kept_ids)
    probs = torch.softmax(z, dim=-1)
    # Zero the -inf entries before the product: 0 * -inf would be NaN, and its gradient too
    # even where a torch.where discards the forward value.
    finite_z = torch.where(torch.isfinite(z), z, torch.zeros((), dtype=z.dtype))
    return torch.logsumexp(z, dim=-1) - (probs * finite_z).sum(-1)


def pad_kept_ids(per_row: list):
    """Stack per-rollout kept sets ([R_i, K_i] int arrays, -1 = padding) into one
    [B, max R, max K] int64 array padded with -1 (numpy, for the collating side)."""
    R = max((k.shape[0] for k in per_row), default=0)
    K = max((k.shape[1] for k in per_row if k.size), default=1)
    out = np.full((len(per_row), R, max(K, 1)), -1, dtype=np.int64)
    for row, k in enumerate(per_row):
        if k.size:
            out[row, :k.shape[0], :k.shape[1]] = k
    return out

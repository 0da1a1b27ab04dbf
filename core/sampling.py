"""The sampled distribution under top-k / top-p truncation, as every side must score it.

The generator samples from the truncated distribution and vLLM reports its log-probs
(``logprobs_mode="processed_logprobs"``). For the KL penalty and the PPO ratio to compare
like with like, the reference and the learner score the same truncated distribution of
their own logits: keep the tokens vLLM's sampler keeps, renormalise over them.

Which tokens are kept follows vLLM's PyTorch sampler (``apply_top_k_top_p_pytorch``):
top-k keeps every logit >= the k-th largest (ties included); top-p then sorts the
survivors ascending, takes the softmax and its running sum, and drops the tokens whose
running sum is <= 1 - p, always keeping the most likely one.

The scored token is always counted as kept. For the sampler it is kept anyway; for the
reference or an updated learner it may fall outside their own nucleus, where its true
truncated log-prob is -inf. Counting it in keeps the KL penalty and the PPO ratio finite
(the penalty is then a lower bound of the true, infinite one) and the gradient defined.
"""
from __future__ import annotations

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
        masked = scaled.masked_fill(~keep, float("-inf"))
        ascending, order = masked.sort(dim=-1)
        running = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = running <= 1 - top_p
        drop[..., -1] = False  # the most likely token always stays
        keep = keep & ~torch.zeros_like(drop).scatter(-1, order, drop)
    return keep


def truncated_logprobs(scaled: Tensor, tokens: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Log-prob [B, T] of ``tokens`` [B, T] under the truncated softmax of ``scaled`` [B, T, V].

    The scored token counts as kept (module docstring). Differentiable in ``scaled``; the
    kept set itself is a discrete choice and carries no gradient.
    """
    idx = tokens.long().unsqueeze(-1)
    keep = kept_tokens(scaled.detach(), top_k, top_p).scatter(-1, idx, True)
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

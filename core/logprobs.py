"""Logits to the sampled distribution's token log-probs and entropy: softmax(logits / T),
truncated as top-k/top-p sampling truncates it (core.sampling). Conventions as in core.masked.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from core import sampling
from core.masked import check_shapes, require

Tensor = torch.Tensor


def _check_temperature(fn: str, temperature: float) -> None:
    require(temperature > 0 and math.isfinite(temperature),
            f"{fn}: temperature must be a finite number > 0, got {temperature}")


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
    check_shapes(fn, "logits batch", logits.shape[:-1], tokens=tokens)
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
        require(tokens is not None, "entropy_from_logits: kept_ids needs the sampled tokens")
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


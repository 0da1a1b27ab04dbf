"""The set of tokens the sampler kept at each position under top-k / top-p, read from vLLM.

Everything downstream scores the truncated distribution over exactly this set
(core/sampling.py), so it has to be the set vLLM's sampler used, not one recomputed from
another model's logits. vLLM reports it through its processed log-probs
(``logprobs_mode="processed_logprobs"``): after top-k / top-p the dropped tokens have
log-prob -inf, so asking for the top ``k`` log-probs of each sampled position returns the
kept tokens with finite values. With ``top_k > 0`` the set has at most k tokens, and k
log-probs per token are all it costs. ``top_p`` alone bounds nothing, so the whole
vocabulary's log-probs come back per token; that is allowed for small vocabularies only
(``MAX_FULL_VOCAB``), as vLLM's own sampling-mask replay requires top_k for the same reason.
"""
from __future__ import annotations

import numpy as np

from core.sampling import is_truncated

# top_p without top_k returns V log-probs per sampled token: ~8 bytes x V. At 4096 tokens
# that is 32 KiB a token; a real vocabulary (32k-256k) would move megabytes per token.
MAX_FULL_VOCAB = 4096
# The kept tokens' renormalised probabilities sum to 1; less means the top-k read missed
# some (exact ties at the k-th logit keep more than k tokens).
_MASS_TOLERANCE = 1e-3


def check_vocab(top_k: int, top_p: float, vocab_size: int, name: str) -> None:
    """Refuse top_p alone on a vocabulary too large to return whole for every token."""
    if top_k == 0 and top_p < 1 and vocab_size > MAX_FULL_VOCAB:
        raise ValueError(
            f"{name}: generator.sampling.top_p={top_p} without top_k needs the whole "
            f"{vocab_size}-token vocabulary's log-probs per sampled token to know which tokens the "
            f"sampler kept; set generator.sampling.top_k as well (e.g. 50), which bounds the set")


def logprob_request(top_k: int, top_p: float) -> dict:
    """SamplingParams arguments for the behaviour log-probs (and the kept set, if truncated)."""
    if not is_truncated(top_k, top_p):
        return {"logprobs": 0}  # exactly the sampled token's entry at each step
    # Flat lists: a constant number of Python objects however many ids come back. No
    # detokenizing: tether reads ids only, and decoding k or V ids per token costs.
    return {"logprobs": top_k if top_k > 0 else -1, "flat_logprobs": True, "detokenize": False}


def read_completion(token_ids: list[int], logprobs) -> tuple[np.ndarray, np.ndarray, int]:
    """From one completion's flat log-probs (``logprob_request`` of a truncated sampler):
    (behaviour log-probs [R] float32, kept ids [R, K] int32 padded with -1, positions whose
    kept set came back incomplete)."""
    ids = np.asarray(logprobs.token_ids, dtype=np.int64)
    values = np.asarray(logprobs.logprobs, dtype=np.float64)
    behaviour = np.empty(len(token_ids), dtype=np.float32)
    sets, incomplete = [], 0
    for t, token in enumerate(token_ids):
        lo, hi = logprobs.start_indices[t], logprobs.end_indices[t]
        at_ids, at_values = ids[lo:hi], values[lo:hi]
        behaviour[t] = at_values[at_ids == token][0]
        finite = np.isfinite(at_values)
        # The sampled token comes first and again in the top-k list: count it once.
        kept, first = np.unique(at_ids[finite], return_index=True)
        incomplete += int(np.exp(at_values[finite][first]).sum() < 1 - _MASS_TOLERANCE)
        sets.append(kept)
    width = max((s.size for s in sets), default=1)
    out = np.full((len(sets), width), -1, dtype=np.int32)
    for t, kept in enumerate(sets):
        out[t, :kept.size] = kept
    return behaviour, out, incomplete

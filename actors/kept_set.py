"""The set of tokens the sampler kept at each position under top-k / top-p, read from vLLM.

Everything downstream scores the truncated distribution over exactly this set
(core/sampling.py), so it has to be the set vLLM's sampler used, not one recomputed from
another model's logits. vLLM reports it through its processed log-probs
(``logprobs_mode="processed_logprobs"``): after top-k / top-p the dropped tokens have
log-prob -inf, so the top log-probs of each sampled position, finite ones only, are the
kept set. ``top_p`` alone bounds nothing, so the whole vocabulary's log-probs come back per
token; that is allowed for small vocabularies only (``MAX_FULL_VOCAB``), as vLLM's own
sampling-mask replay requires top_k for the same reason.

With ``top_k > 0`` the set is every token whose logit is >= the k-th largest, ties
included (vLLM's ``apply_top_k_only`` and ``apply_top_k_top_p_pytorch`` mask ``logits <
kth``): more than k tokens whenever several share the k-th logit, which bf16 logits (256
values per power of two) do at 18% of positions on the pre-trained tiny policy at top_k
20 (up to 5 tokens past k). Reading exactly k log-probs cut those sets short, and the
reference and the learner renormalised over fewer tokens than the sampler. So the
generator reads ``top_k + max(top_k, TIE_MARGIN)`` (``logprobs_to_read``) and keeps the
finite ones: only a tie of that many more tokens at the k-th logit goes past the read. A
position whose read came back all finite may hold more; it is counted as incomplete (the
step metric ``rollouts/incomplete_kept_sets``). The cost is the margin's entries in
vLLM's output: 8 bytes each in its tensors (int32 id, float32 log-prob) and two Python
list items in the flat lists, 160 bytes a token more at top_k 20. The rollout itself
stores the kept ids only.
"""
from __future__ import annotations

import numpy as np

from core.sampling import is_truncated

# top_p without top_k returns V log-probs per sampled token: ~8 bytes x V. At 4096 tokens
# that is 32 KiB a token; a real vocabulary (32k-256k) would move megabytes per token.
MAX_FULL_VOCAB = 4096
# Extra log-probs read beyond top_k, at least: tokens tied with the k-th logit. The largest
# tie measured on the pre-trained tiny policy in bf16 at top_k 20 was 5 tokens past k.
TIE_MARGIN = 16


def check_vocab(top_k: int, top_p: float, vocab_size: int, name: str) -> None:
    """Refuse top_p alone on a vocabulary too large to return whole for every token."""
    if top_k == 0 and top_p < 1 and vocab_size > MAX_FULL_VOCAB:
        raise ValueError(
            f"{name}: generator.sampling.top_p={top_p} without top_k needs the whole "
            f"{vocab_size}-token vocabulary's log-probs per sampled token to know which tokens the "
            f"sampler kept; set generator.sampling.top_k as well (e.g. 50), which bounds the set")


def logprobs_to_read(top_k: int, vocab_size: int) -> int:
    """How many top log-probs a truncated sampler's position is read with: -1 = the whole
    vocabulary (top_p alone, or a margin that reaches the vocabulary's size)."""
    if top_k == 0:
        return -1
    wanted = top_k + max(top_k, TIE_MARGIN)
    return -1 if wanted >= vocab_size else wanted


def logprob_request(top_k: int, top_p: float, vocab_size: int) -> dict:
    """SamplingParams arguments for the behaviour log-probs (and the kept set, if truncated).

    Flat lists: a constant number of Python objects however many ids come back. No
    detokenizing: tether reads ids only, and vLLM would otherwise decode the response and
    every log-prob's token as it samples (a tenth of a 31.7M model's generate call on CPU)."""
    read = logprobs_to_read(top_k, vocab_size) if is_truncated(top_k, top_p) else 0  # 0: the sampled token's
    return {"logprobs": read, "flat_logprobs": True, "detokenize": False}


def read_sampled(token_ids: list[int], logprobs) -> np.ndarray:
    """[R] float32 behaviour log-probs from the flat log-probs of an untruncated sampler
    (``logprob_request``: one entry per position, the sampled token's)."""
    starts = np.asarray(logprobs.start_indices, dtype=np.int64)
    if len(starts) != len(token_ids) or not np.array_equal(np.asarray(logprobs.token_ids)[starts], token_ids):
        raise ValueError(f"vLLM returned log-probs for {len(starts)} positions that are not the "
                         f"{len(token_ids)} sampled tokens")
    return np.asarray(logprobs.logprobs, dtype=np.float32)[starts]


def read_completion(token_ids: list[int], logprobs, read: int) -> tuple[np.ndarray, np.ndarray, int]:
    """From one completion's flat log-probs (``logprob_request`` of a truncated sampler, its
    ``read`` top log-probs per position, -1 = all): (behaviour log-probs [R] float32, kept
    ids [R, K] int32 padded with -1, positions whose kept set may be incomplete)."""
    ids = np.asarray(logprobs.token_ids, dtype=np.int64)
    values = np.asarray(logprobs.logprobs, dtype=np.float64)
    behaviour = np.empty(len(token_ids), dtype=np.float32)
    sets, incomplete = [], 0
    for t, token in enumerate(token_ids):
        lo, hi = logprobs.start_indices[t], logprobs.end_indices[t]
        at_ids, at_values = ids[lo:hi], values[lo:hi]
        behaviour[t] = at_values[at_ids == token][0]
        finite = np.isfinite(at_values)
        # The sampled token comes first and again in the top list: count it once.
        kept = np.unique(at_ids[finite])
        # Fewer finite ids than were read: the read reached the -inf tail, so it holds the
        # whole set. As many: the set may go on past the read (a tie wider than the margin).
        incomplete += int(read > 0 and kept.size >= read)
        sets.append(kept)
    width = max((s.size for s in sets), default=1)
    out = np.full((len(sets), width), -1, dtype=np.int32)
    for t, kept in enumerate(sets):
        out[t, :kept.size] = kept
    return behaviour, out, incomplete

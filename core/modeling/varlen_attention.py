"""Varlen attention: a packed row's attention computed per sequence, not over the whole row.

A packed micro-batch (learner/packing.py) is one row [1, T] of several sequences. With sdpa or
eager attention, transformers turns the restarting position ids into a block-diagonal causal
mask of T x T and the kernel computes every one of those T^2 scores, masked or not; on a
workload with little padding that is more attention work than the padded batch did. Here the
row is cut at its sequence boundaries and each sequence (or each run of consecutive
sequences of one length, batched) goes through causal sdpa on its own: L^2 per sequence, no
T x T mask built at all, the same outputs as the masked attention up to rounding.

transformers' public registries carry it, no library internals patched: ``VARLEN`` is an
attention function (``AttentionInterface``) and a mask function (``AttentionMaskInterface``)
that ``use_varlen`` sets as a model's attention implementation. The sequence boundaries come
with the forward's own keyword arguments, ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (transformers
hands them on to every attention call, as it does for flash-attention), computed once per
forward by ``pack``. A padded batch's mask is built by sdpa's mask function and applied by
sdpa's attention function, so the padded forward of the same model runs as configured; with no
mask and no offsets (an unpadded batch) each row is one causal sequence, so a packed row must
come with its offsets (``boundaries``: PolicyWithValueHead passes them). Without a padding
mask the mask function builds nothing, so the packed-row detection and any mask overlays of
transformers' masks are skipped (the text families use none). The dispatch depends on a
call's arguments alone, so gradient checkpointing's recompute takes the path its forward took.

Where varlen does not apply, ``use_varlen`` keeps the model's attention (and packed rows keep
the masked path): attention logit soft-capping (Gemma-2, eager attention, so the learner scores
what vLLM samples) and any implementation but sdpa (flash-attention reads the boundaries from
the position ids itself). Sliding windows are honoured: a sequence longer than its layer's
window gets a banded causal mask of its own length only.

Not done: with the ``flash_attn`` package on a GPU, ``flash_attn_varlen_func`` would take the
whole row in one kernel; torch's sdpa already dispatches each causal sequence to its own flash
kernel on CUDA, at one kernel launch per run of sequences.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

log = logging.getLogger(__name__)

VARLEN = "tether_varlen"
Tensor = torch.Tensor


def _sdpa():
    from transformers import AttentionInterface
    return AttentionInterface()["sdpa"]


def varlen_mask(*, attention_mask: Optional[Tensor] = None, **kwargs):
    """The mask function: none for a row without a padding mask (a packed row, whose boundaries
    come as ``cu_seq_lens_q``, or an unpadded batch: causal), else sdpa's mask of the padded batch."""
    if attention_mask is None:
        return None
    from transformers import AttentionMaskInterface
    return AttentionMaskInterface()["sdpa"](attention_mask=attention_mask, **kwargs)


def varlen_attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                             attention_mask: Optional[Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                             sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                             is_causal: Optional[bool] = None, cu_seq_lens_q: Optional[Tensor] = None,
                             cu_seq_lens_k: Optional[Tensor] = None, **kwargs) -> tuple[Tensor, None]:
    """query [B, H, T, D], key/value [B, Hkv, T, D] -> ([B, T, H, D], None), as transformers'
    attention functions. With a mask: transformers' sdpa. Without: causal attention within
    each sequence of ``cu_seq_lens_q`` ([n+1] offsets into a single row), or within each row."""
    if attention_mask is not None:
        return _sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                       is_causal=is_causal, sliding_window=sliding_window, softcap=softcap, **kwargs)
    if softcap is not None:  # use_varlen keeps such families on their own attention
        raise ValueError(f"{VARLEN} attention: soft-capping ({softcap}) is not supported; use eager attention")
    if query.shape[2] != key.shape[2] or (cu_seq_lens_k is not None and cu_seq_lens_q is not None
                                          and not torch.equal(cu_seq_lens_k, cu_seq_lens_q)):
        raise ValueError(f"{VARLEN} attention: self-attention over whole sequences only (no KV cache): "
                         f"{query.shape[2]} queries, {key.shape[2]} keys")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    spec = dict(scale=scaling, dropout_p=dropout, causal=causal, window=sliding_window,
                gqa=getattr(module, "num_key_value_groups", 1) > 1)
    if cu_seq_lens_q is None:  # one sequence per row
        return _attend(query, key, value, **spec).transpose(1, 2).contiguous(), None
    if query.shape[0] != 1:
        raise ValueError(f"{VARLEN} attention: cu_seq_lens_q needs one packed row, got a batch of {query.shape[0]}")
    parts = runs(cu_seq_lens_q)
    if sum(n * length for _, n, length in parts) != query.shape[2]:
        raise ValueError(f"{VARLEN} attention: cu_seq_lens_q ends at {int(cu_seq_lens_q[-1])}, "
                         f"the row has {query.shape[2]} tokens")
    outs = [_attend(*(_rows(t, start, n, length) for t in (query, key, value)), **spec)
            for start, n, length in parts]
    # Each run's [n, H, L, D] back to its tokens in row order: [n*L, H, D] per run, end to end.
    return torch.cat([o.transpose(1, 2).flatten(0, 1) for o in outs])[None], None


def runs(cu_seq_lens: Tensor) -> list[tuple[int, int, int]]:
    """(start, count, length) of each run of consecutive sequences of one length (empty ones
    dropped), from the offsets ``cu_seq_lens`` [n+1]."""
    cu = cu_seq_lens.tolist()
    out: list[list[int]] = []
    for start, end in zip(cu[:-1], cu[1:]):
        length = end - start
        if not length:
            continue
        if out and out[-1][2] == length and out[-1][0] + out[-1][1] * length == start:
            out[-1][1] += 1
        else:
            out.append([start, 1, length])
    return [tuple(r) for r in out]


def _rows(t: Tensor, start: int, n: int, length: int) -> Tensor:
    """[1, H, T, D] -> [n, H, length, D]: ``n`` sequences of ``length`` from ``start`` (a view)."""
    seg = t[0, :, start:start + n * length]  # [H, n*L, D]
    return seg.unflatten(1, (n, length)).transpose(0, 1)


def _attend(q: Tensor, k: Tensor, v: Tensor, *, scale, dropout_p, causal, window, gqa) -> Tensor:
    """Attention within each of the batch's rows [b, H, L, D]: causal (upper-left aligned,
    query and key of one length), a banded mask when a window of ``window`` tokens is shorter
    than the row (a query sees itself and the window - 1 keys before it, as transformers'
    sliding-window mask)."""
    length = q.shape[2]
    mask = None
    if not causal and window is not None and length > window:
        raise ValueError(f"{VARLEN} attention: a sliding window on bidirectional attention is not supported")
    if causal and window is not None and length > window:
        i = torch.arange(length, device=q.device)
        mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)  # [L, L] True: attend
        causal = False
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                            is_causal=causal, scale=scale, enable_gqa=gqa)


def fallback_reason(config) -> Optional[str]:
    """Why a model of ``config`` keeps its own attention for packed rows, or None: it can run varlen."""
    impl = config._attn_implementation
    if impl == VARLEN:
        return None
    if getattr(config, "attn_logit_softcapping", None):
        return f"attention logit soft-capping ({config.attn_logit_softcapping}) runs in {impl} attention"
    if getattr(config, "use_bidirectional_attention", False) or not getattr(config, "is_causal", True):
        return "bidirectional attention"
    if impl != "sdpa":
        return f"{impl} attention is kept (varlen replaces sdpa only)"
    return None


def use_varlen(model) -> str:
    """Set ``model`` (an HF model) to varlen attention where ``fallback_reason`` allows it; ->
    the attention implementation its packed forwards run."""
    reason = fallback_reason(model.config)
    if reason:
        log.info("%s: packed rows keep the block-diagonal mask: %s", type(model).__name__, reason)
        return model.config._attn_implementation
    from transformers import AttentionInterface, AttentionMaskInterface
    AttentionInterface.register(VARLEN, varlen_attention_forward)  # idempotent: a name in a table
    AttentionMaskInterface.register(VARLEN, varlen_mask)
    model.set_attn_implementation(VARLEN)
    return VARLEN


def boundaries(model, cu_seq_lens: Optional[Tensor]) -> dict:
    """The forward's keyword arguments for a packed row with these sequence offsets: the
    offsets for a model on varlen attention; nothing for any other (its masks find them in
    the position ids), nor for a row that is not packed (``cu_seq_lens`` None)."""
    if cu_seq_lens is None or model.config._attn_implementation != VARLEN:
        return {}
    return {"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens}


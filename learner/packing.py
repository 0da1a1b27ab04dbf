"""Padding-free micro-batches: a Batch's real tokens packed into one row, and back.

The padded layout (learner/batch.py) runs every micro-batch as [B, P+R], so a batch of
ragged responses spends most of its forward on padding. Packed, a micro-batch is ONE row
[1, T]: each row's prompt without its left padding, then its response without its right
padding, rows one after the other; position ids restart at 0 at each row's first token, and
there is NO attention mask. From those position ids transformers builds a block-diagonal
causal mask (masking_utils.find_packed_sequence_indices: a new sequence starts wherever the
position does not grow by 1), for sdpa and eager attention alike, and flash-attention reads
them as sequence boundaries. An all-ones attention mask instead would switch that detection
off and let every sequence attend to the ones before it, silently: never pass one. A model on
varlen attention (core/modeling/varlen_attention.py) takes the boundaries as offsets instead
(``cu_seq_lens``) and attends within each sequence, with no T x T mask at all.

The LM head runs only where a logit predicts a response token (``logits_to_keep`` as an index
tensor), so a family's own head and whatever follows it (Gemma-2's final soft-capping) run
as in the padded path, and the outputs are scattered back into the batch's [B, R] layout:
every loss, KL, advantage and metric downstream is unchanged.

Two implementations of where the response tokens are, one interface (``keep``, ``tokens``,
``hidden``, ``logits``, ``select``, ``scatter``): ``PaddedResponses`` and ``PackedResponses``;
``Padded`` and ``Packed`` turn a micro-batch into the forward's inputs either way.
Micro-batches themselves are cut by ``row_groups``: length-sorted chunks of a number of rows,
or (with a token budget) ``token_bins``.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from core.modeling.packed_rows import pack_sequences
from learner.batch import Batch, response_slice

Tensor = torch.Tensor


class PaddedResponses:
    """Responses at columns P.. of a padded [B, P+R] input (learner/batch.py's layout)."""

    def __init__(self, input_ids: Tensor, prompt_len: int) -> None:
        self.prompt_len, self.response_len = prompt_len, input_ids.shape[1] - prompt_len
        self.keep = self.response_len + 1  # logits_to_keep: the last R+1 columns (the very last predicts nothing)
        self.tokens = input_ids[:, prompt_len:]  # [B, R]

    def hidden(self, states: Tensor) -> Tensor:
        """[B, P+R, ...] -> [B, R, ...]: the columns that predict response tokens."""
        return response_slice(states, self.prompt_len, self.response_len)

    def logits(self, logits: Tensor) -> Tensor:
        """[B, R+1, V] (the kept columns) -> [B, R, V]."""
        return logits[:, :self.response_len]

    def select(self, per_token: Optional[Tensor]) -> Optional[Tensor]:
        """[B, R, ...] per response token -> the same (already in this layout)."""
        return per_token

    def scatter(self, out: Optional[Tensor]) -> Optional[Tensor]:
        """[B, R] -> [B, R]."""
        return out


@dataclass
class PackedResponses:
    """A micro-batch as one packed row, and where its response tokens sit in the [B, R] layout."""
    input_ids: Tensor     # [1, T] int64: the rows' real tokens, one row after the other
    position_ids: Tensor  # [1, T] int64: 0.. within each row (the sequence boundaries)
    positions: Tensor     # [N] int64: packed columns whose logits predict a response token
    rows: Tensor          # [N] int64: that token's row in [B, R]
    cols: Tensor          # [N] int64: its column in [B, R]
    shape: tuple          # (B, R)
    cu_seq_lens: Tensor   # [B+1] int64 on the CPU: where each row's sequence starts in the packed row, then T

    @property
    def keep(self) -> Tensor:
        return self.positions  # logits_to_keep as an index tensor: the LM head runs there only

    @property
    def tokens(self) -> Tensor:
        """[1, N] the response tokens, each one column after the position predicting it."""
        return self.input_ids[:, self.positions + 1]

    def hidden(self, states: Tensor) -> Tensor:
        """[1, T, ...] -> [1, N, ...] at the predicting positions."""
        return states[:, self.positions]

    def logits(self, logits: Tensor) -> Tensor:
        """[1, N, V]: the LM kept those positions only."""
        return logits

    def select(self, per_token: Optional[Tensor]) -> Optional[Tensor]:
        """[B, R, ...] -> [1, N, ...] (e.g. the sampler's kept sets)."""
        return None if per_token is None else per_token[self.rows, self.cols][None]

    def scatter(self, out: Optional[Tensor]) -> Optional[Tensor]:
        """[1, N] -> [B, R], zeros where no token was (out of place: gradients flow back)."""
        if out is None:
            return None
        return out.new_zeros(self.shape).index_put((self.rows, self.cols), out[0])


def pack(batch: Batch) -> PackedResponses:
    """Pack a Batch's real tokens (attention_mask 1) into one row, row-major: each row's prompt
    then its response. Response tokens are the real tokens at columns P.. (a blank micro-batch's,
    response_mask 0, are scored too, as in the padded path, and masked downstream)."""
    real = batch.attention_mask.bool()                          # [B, P+R]
    at = real.flatten().long().cumsum(0).view_as(real) - 1       # [B, P+R] each real token's packed column
    P = batch.prompt_len
    rows, cols = real[:, P:].nonzero(as_tuple=True)             # [N] each, row-major
    return PackedResponses(input_ids=batch.input_ids[real][None], position_ids=batch.position_ids[real][None],
                           positions=at[rows, P + cols] - 1, rows=rows, cols=cols,
                           shape=(len(batch), batch.response_len),
                           cu_seq_lens=torch.nn.functional.pad(real.sum(1).cumsum(0), (1, 0)).cpu())


def pack_examples(examples: Sequence[Sequence[np.ndarray]], device=None) -> PackedResponses:
    """Token sequences, each given in parts (e.g. (prompt, response)) whose LAST part is what
    the outputs are of, as one packed row: the last parts' tokens in the [B, R] layout (R the
    longest last part). Every sequence needs a token before its last part (what predicts it)."""
    heads = [sum(len(a) for a in parts[:-1]) for parts in examples]
    if min(heads, default=0) < 1:
        raise ValueError("pack_examples: every sequence needs a token before its last part (a prompt)")
    row = pack_sequences([np.concatenate(parts).astype(np.int64) for parts in examples], device)
    lasts = [len(parts[-1]) for parts in examples]
    rows = torch.from_numpy(np.repeat(np.arange(len(examples)), lasts)).to(row.input_ids.device)
    cols = torch.from_numpy(np.concatenate([np.arange(n) for n in lasts]).astype(np.int64)).to(rows.device)
    return PackedResponses(input_ids=row.input_ids, position_ids=row.position_ids, positions=row.predicting(heads),
                           rows=rows, cols=cols, shape=(len(examples), max(lasts)), cu_seq_lens=row.cu_seq_lens)


class Padded:
    """A micro-batch's forward over its padded [b, P+R] rows (trimmed of all-padding columns)."""

    @staticmethod
    def inputs(mb: Batch) -> tuple[tuple, dict]:
        """(input_ids, attention_mask, position_ids) and the forward's layout argument."""
        return (mb.input_ids, mb.attention_mask, mb.position_ids), {"prompt_len": mb.prompt_len}

    @staticmethod
    def fed(mb: Batch) -> int:
        """Positions the forward runs on, padding included."""
        return mb.input_ids.numel()


class Packed:
    """A micro-batch's forward over one packed row (``pack``): no padding at all."""

    @staticmethod
    def inputs(mb: Batch) -> tuple[tuple, dict]:
        packed = pack(mb)
        return (packed.input_ids, None, packed.position_ids), {"packed": packed}

    @staticmethod
    def fed(mb: Batch) -> int:
        return int(mb.attention_mask.sum())


def row_lengths(batch: Batch) -> np.ndarray:
    """[B] int64 real tokens of each row (prompt + response): its packed length."""
    return batch.attention_mask.sum(1).cpu().numpy().astype(np.int64)


def row_groups(lengths: np.ndarray, micro_batch_size: int, max_tokens: int = 0, *,
               by_length: bool = True) -> list[np.ndarray]:
    """Row indices of each micro-batch of a minibatch with these row ``lengths`` [B].

    ``max_tokens`` 0: chunks of ``micro_batch_size`` rows, sorted by length first (stable) when
    ``by_length`` (the padded path pads less so; the minibatch, so the gradient, is the same),
    else in order. Else ``token_bins``: micro-batches of at most ``max_tokens`` tokens each."""
    if max_tokens:
        return [np.asarray(b, dtype=np.int64) for b in token_bins(lengths.tolist(), max_tokens)]
    order = np.argsort(lengths, kind="stable") if by_length else np.arange(len(lengths))
    return [order[i:i + micro_batch_size] for i in range(0, len(order), micro_batch_size)]


def token_bins(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Row indices per bin: each bin's total length <= ``budget`` (a row longer than the budget
    alone in a bin of its own), in few bins with balanced loads. Depends on the lengths alone,
    so every rank and a resumed run cut the same bins.

    Greedy longest-first (LPT) into k bins, k from a lower bound up (the rows over the budget
    plus ceil(the other rows' total / budget)): rows longest first (ties: lower index first),
    each to the least-loaded bin (ties: the lower bin); if that one cannot take a row no bin
    can, so k grows by one and it starts over. Bins come out in creation order (bin 0 took the
    longest row), rows in index order within."""
    if budget < 1:
        raise ValueError(f"token_bins: budget must be >= 1, got {budget}")
    n = len(lengths)
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    over = sum(1 for x in lengths if x > budget)  # each fills a bin alone
    k = min(n, max(1, over + -(-sum(x for x in lengths if x <= budget) // budget)))
    while n:
        bins = _fill(order, lengths, budget, k)
        if bins is not None:
            return [sorted(b) for b in bins if b]
        k += 1
    return []


def _fill(order: list[int], lengths: Sequence[int], budget: int, k: int) -> Optional[list[list[int]]]:
    """``order``'s rows into ``k`` bins, each to the least-loaded; None when one fits nowhere."""
    heap = [(0, b) for b in range(k)]  # (load, bin)
    bins: list[list[int]] = [[] for _ in range(k)]
    for i in order:
        load, b = heapq.heappop(heap)
        if load and load + lengths[i] > budget:
            return None
        bins[b].append(i)
        heapq.heappush(heap, (load + lengths[i], b))
    return bins

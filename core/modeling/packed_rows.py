"""Token sequences of different lengths as one packed row: a forward with no padding.

The scorers (the reference, the reward model) and the supervised stages hold sequences of
different lengths. Padded to the longest, most of a ragged batch's forward is spent on
padding. Packed, the sequences run as ONE row [1, T], end to end: position ids restart at 0
at each sequence's first token and there is no attention mask. A model on varlen attention
(core/modeling/varlen_attention.py) takes the sequence offsets ``cu_seq_lens`` and attends within each
sequence; any other model finds the same boundaries in the position ids (transformers builds
a block-diagonal causal mask from them when the attention mask is None). An all-ones mask
would switch that detection off and let sequences attend to each other: never pass one.

The learner packs its padded Batches itself (learner/packing.py); this module packs plain
token arrays.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from core.modeling.varlen_attention import boundaries

Tensor = torch.Tensor


@dataclass
class PackedRow:
    input_ids: Tensor     # [1, T] int64: the sequences end to end
    position_ids: Tensor  # [1, T] int64: 0.. within each sequence
    cu_seq_lens: Tensor   # [n+1] int64 on the CPU: where each sequence starts, then T

    @property
    def starts(self) -> np.ndarray:
        """[n] each sequence's first column."""
        return self.cu_seq_lens[:-1].numpy()

    @property
    def ends(self) -> np.ndarray:
        """[n] one past each sequence's last column."""
        return self.cu_seq_lens[1:].numpy()

    def inputs(self, model) -> dict:
        """The forward's keyword arguments for ``model`` (an HF model): the row, no mask, and the
        offsets where the model attends per sequence."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "attention_mask": None,
                **boundaries(model, self.cu_seq_lens)}

    def predicting(self, first: Sequence[int]) -> Tensor:
        """[N] int64 the columns whose logits predict tokens ``first[i]`` .. the end of sequence
        i, sequence after sequence (``first[i]`` >= 1: a first token has nothing to predict it)."""
        cols = [np.arange(s + f - 1, e - 1) for s, e, f in zip(self.starts, self.ends, first)]
        return torch.from_numpy(np.concatenate(cols).astype(np.int64)).to(self.input_ids.device)


def pack_sequences(seqs: Sequence[np.ndarray], device=None) -> PackedRow:
    """``seqs`` (each [L_i] int64, L_i >= 1) as one packed row on ``device``."""
    lengths = np.array([s.size for s in seqs], dtype=np.int64)
    if lengths.size == 0 or lengths.min() < 1:
        raise ValueError(f"pack_sequences: every sequence needs a token; lengths {lengths.tolist()}")
    ids = torch.from_numpy(np.concatenate(seqs).astype(np.int64))[None]
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]))
    pos = torch.arange(int(cu[-1])) - torch.repeat_interleave(cu[:-1], torch.from_numpy(lengths))
    return PackedRow(input_ids=ids.to(device), position_ids=pos[None].to(device), cu_seq_lens=cu)

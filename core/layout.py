"""Token layouts: how rows of token ids become one padded batch a causal LM can run.

Two layouts serve every model call in the project:

  * prompt | response (``pad_prompt_response``): prompts LEFT-padded to the longest
    prompt P, responses RIGHT-padded to the longest response R, so every response starts
    at column P and one slice of the logits serves the whole batch (reference, learner):

        row 0:  [pad pad p p p | r r r r pad]
        row 1:  [p p p p p     | r r pad pad pad]
                 <---- P ----->  <----- R ----->

  * right-padded (``pad_right``): whole sequences from column 0 (reward model, SFT, PTX).

Position ids count real tokens only (``position_ids``), so left padding shifts no prompt;
a right-padded row's last real token (``last_token_index``) is where sequence scores pool.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

Tensor = torch.Tensor


def pad_right(seqs: Sequence[np.ndarray], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Sequences of lengths L_i -> (ids [B, T] int64, attention_mask [B, T] int64), T = max L_i.

    Row i holds seqs[i] in columns 0 .. L_i - 1, then ``pad_id``; the mask is 1 on those
    columns. ``seqs`` is non-empty; a sequence may be empty (its row is all padding).
    """
    T = max(len(s) for s in seqs)
    ids = np.full((len(seqs), T), pad_id, dtype=np.int64)
    mask = np.zeros((len(seqs), T), dtype=np.int64)
    for row, s in enumerate(seqs):
        ids[row, :len(s)] = s
        mask[row, :len(s)] = 1
    return ids, mask


def pad_prompt_response(prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray],
                        pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompts [P_i] and responses [R_i] -> (ids [B, P+R] int64, attention_mask [B, P+R] int64).

    P = max P_i, R = max R_i: prompt i fills columns P - P_i .. P - 1 and response i columns
    P .. P + R_i - 1 (the layout in the module docstring); the rest is ``pad_id``, mask 0.
    """
    P = max(len(p) for p in prompts)
    R = max(len(r) for r in responses)
    ids = np.full((len(prompts), P + R), pad_id, dtype=np.int64)
    mask = np.zeros((len(prompts), P + R), dtype=np.int64)
    for row, (p, r) in enumerate(zip(prompts, responses)):
        ids[row, P - len(p):P] = p
        ids[row, P:P + len(r)] = r
        mask[row, P - len(p):P + len(r)] = 1
    return ids, mask


def position_ids(attention_mask: Tensor) -> Tensor:
    """[B, T] positions counting real tokens only (the k-th real token of a row is at k - 1);
    padding before the first real token gets 0 (it is masked anyway). int64."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def last_token_index(attention_mask: Tensor) -> Tensor:
    """[B] column of each right-padded row's last real token (its length - 1)."""
    return attention_mask.sum(-1) - 1


def pool_last_token(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """hidden [B, T, H] of right-padded rows -> [B, H] at each row's last real token.

    Where a sequence classifier reads its score. Not HF's own pooling (the last token
    whose id is not the pad id), which is wrong when pad == eos and a row ends in eos.
    """
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    return hidden[rows, last_token_index(attention_mask)]

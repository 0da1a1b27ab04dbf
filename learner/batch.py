"""Padding ScoredRollouts into one batch of tensors the learner can run.

Layout (core.layout's prompt | response): prompts LEFT-padded to the batch's longest
prompt P, responses RIGHT-padded to the longest response R, so every response starts at
column P and one slice of the logits serves the whole batch. Logits at columns
P-1 .. P+R-2 predict the response tokens (see ``response_slice``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from core.layout import pad_prompt_response, pad_right, position_ids
from core.rollout import Rollout, ScoredRollout
from core.sampling import pad_kept_ids

Tensor = torch.Tensor
FULL_WIDTH = ("input_ids", "attention_mask", "position_ids")  # [B, P+R]; other 2-D fields are [B, R]


@dataclass
class Batch:
    input_ids: Tensor             # [B, P+R] int64: left-padded prompt + right-padded response
    attention_mask: Tensor        # [B, P+R] int64: 1 on real tokens
    position_ids: Tensor          # [B, P+R] int64: counts real tokens only (left padding must not shift them)
    response_mask: Tensor         # [B, R] float32: 1.0 on valid response tokens
    behaviour_logprobs: Tensor    # [B, R] float32: sampler (vLLM) logprobs
    reference_logprobs: Tensor    # [B, R] float32
    rewards: Tensor               # [B, R] float32: per-token rewards, score folded in
    scores: Tensor                # [B] float32: sequence scores (for metrics)
    prompt_len: int               # P: column where every response starts
    kept_ids: Optional[Tensor] = None  # [B, R, K] int64: truncated sampling's kept sets (-1 = padding)
    teacher_logprobs: Optional[Tensor] = None  # [B, R] float32: the teacher's, in a run with one (core/distill.py)
    # Filled in by the learner before the epochs; same [B, R] layout.
    old_logprobs: Optional[Tensor] = None
    old_values: Optional[Tensor] = None
    advantages: Optional[Tensor] = None
    returns: Optional[Tensor] = None
    is_weights: Optional[Tensor] = None  # behaviour -> old-policy importance weights (ppo.off_policy)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_len(self) -> int:
        return self.response_mask.shape[1]

    @property
    def response_ids(self) -> Tensor:
        """[B, R] the response tokens (padding where response_mask is 0)."""
        return self.input_ids[:, self.prompt_len:]

    def num_tokens(self) -> int:
        return int(self.response_mask.sum().item())

    def _map(self, fn) -> "Batch":
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = fn(value) if isinstance(value, Tensor) else value
        return Batch(**out)

    def __getitem__(self, rows) -> "Batch":
        """Rows by slice, list or index tensor; columns (P, R) are kept."""
        if isinstance(rows, (list, np.ndarray)):
            rows = torch.as_tensor(rows, dtype=torch.long)
        return self._map(lambda t: t[rows])

    def split(self, size: int) -> list["Batch"]:
        """Consecutive chunks of at most ``size`` rows (the last may be smaller)."""
        if size < 1:
            raise ValueError(f"Batch.split: size must be >= 1, got {size}")
        return [self[i:i + size] for i in range(0, len(self), size)]

    def trimmed(self) -> "Batch":
        """Drop columns that are padding in every row (left of the prompts, right of the responses).

        Positions are unchanged (padding never counted), so outputs on real tokens are too.
        """
        P = self.prompt_len
        real_prompt_cols = self.attention_mask[:, :P].sum(0) > 0
        first = int(real_prompt_cols.nonzero()[0]) if bool(real_prompt_cols.any()) else P - 1
        first = min(first, P - 1)  # keep >= 1 prompt column: it predicts the first response token
        valid_cols = (self.response_mask.sum(0) > 0).nonzero()
        R = int(valid_cols[-1]) + 1 if len(valid_cols) else 1
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in FULL_WIDTH:
                v = v[:, first:P + R]
            elif isinstance(v, Tensor) and v.dim() in (2, 3):  # [B, R] and [B, R, K]
                v = v[:, :R]
            out[f.name] = v
        out["prompt_len"] = P - first
        return Batch(**out)

    def to(self, device) -> "Batch":
        return self._map(lambda t: t.to(device))


def response_slice(logits_or_hidden: Tensor, prompt_len: int, response_len: int) -> Tensor:
    """Columns P-1 .. P+R-2 of a [B, P+R, ...] tensor: those predicting response tokens.

    Works on logits and on hidden states (slicing hidden states before the LM
    head saves computing a [B, P, V] block nobody reads).
    """
    return logits_or_hidden[:, prompt_len - 1:prompt_len + response_len - 1]


def collate(rollouts: Sequence[ScoredRollout | Rollout], pad_id: int) -> Batch:
    """Pad rollouts into a Batch (see module docstring for the layout).

    Raises ValueError for an empty list, an empty prompt (the first response token
    needs context) or a batch with no response token at all.
    """
    if not rollouts:
        raise ValueError("collate: empty rollout list")
    for i, r in enumerate(rollouts):
        if r.prompt_ids.size == 0:
            raise ValueError(f"collate: rollout {i} (prompt_index={r.prompt_index}) has an empty prompt")
    P = max(r.prompt_ids.size for r in rollouts)
    R = max(r.response_ids.size for r in rollouts)
    if R == 0:
        raise ValueError(f"collate: zero valid response tokens in a batch of {len(rollouts)} rollouts; "
                         "drop empty responses before training")
    B = len(rollouts)
    ids, attn = pad_prompt_response([r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts], pad_id)
    per_token = {k: np.zeros((B, R), dtype=np.float32)
                 for k in ("response_mask", "behaviour_logprobs", "reference_logprobs", "rewards")}
    for row, r in enumerate(rollouts):
        n = r.response_ids.size
        # From here response_mask means "trained": an environment's tokens are context only.
        per_token["response_mask"][row, :n] = 1.0 if r.action_mask is None else r.action_mask
        per_token["behaviour_logprobs"][row, :n] = r.behaviour_logprobs
        # Plain Rollouts (no reference / rewards yet) collate too: for scoring only.
        if getattr(r, "reference_logprobs", None) is not None:
            per_token["reference_logprobs"][row, :n] = r.reference_logprobs
            per_token["rewards"][row, :n] = r.rewards
    attention_mask = torch.from_numpy(attn)
    kept = [r.kept_ids for r in rollouts]
    if any(k is not None for k in kept):
        if any(k is None for k in kept):
            raise ValueError("collate: some rollouts carry a kept set (truncated sampling) and some do not")
        per_token["kept_ids"] = pad_kept_ids(kept)
    teachers = [getattr(r, "teacher_logprobs", None) for r in rollouts]
    if any(t is not None for t in teachers):
        if any(t is None for t in teachers):
            raise ValueError("collate: some rollouts carry teacher log-probs and some do not")
        per_token["teacher_logprobs"] = np.zeros((B, R), dtype=np.float32)
        for row, t in enumerate(teachers):
            per_token["teacher_logprobs"][row, :t.size] = t
    return Batch(input_ids=torch.from_numpy(ids), attention_mask=attention_mask,
                 position_ids=position_ids(attention_mask),
                 scores=torch.tensor([float(getattr(r, "score", 0.0)) for r in rollouts], dtype=torch.float32),
                 prompt_len=P, **{k: torch.from_numpy(v) for k, v in per_token.items()})


def collate_lm(sequences: Sequence, pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-pad plain token sequences (PTX batch) -> (input_ids [B, T], attention_mask [B, T])."""
    seqs = [np.asarray(s, dtype=np.int64).reshape(-1) for s in sequences]
    if not seqs or max(s.size for s in seqs) < 2:
        raise ValueError("collate_lm: the PTX batch needs at least one sequence of >= 2 tokens")
    ids, mask = pad_right(seqs, pad_id)
    return torch.from_numpy(ids), torch.from_numpy(mask)

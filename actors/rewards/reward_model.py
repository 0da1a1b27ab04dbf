"""A frozen reward model's scores: a sequence classifier (num_labels=1) read at each sequence's
last token, over the prompt+response token ids the policy sampled (so the reward model shares
the policy's vocabulary; nothing is decoded).

Sequences run ``batch_size`` at a time, length-sorted, as one packed row
(core/modeling/packed_rows.py) with ``packing``, else right-padded. With ``normalize`` the raw
scores are standardised by the mean and std the reward-model stage saved beside its checkpoint
(``reward_stats.json``), so the PPO run sees mean 0, std 1 over the RM's training responses.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from actors.rewards.scoring import ScoreResult, finalise
from core.infra.errors import type_and_first_line
from core.layout import pad_right, pool_last_token
from core.modeling.architectures import load_pretrained
from core.modeling.loading import length_sorted_chunks, load_tokenizer, pad_token_id, resolve_model_path
from core.modeling.packed_rows import pack_sequences
from core.modeling.varlen_attention import use_varlen

# Written by the reward-model stage (cluster/recipes/reward_model.py) beside its checkpoint: the mean
# and std of the model's scores over its training responses, for reward.normalize.
REWARD_STATS_FILE = "reward_stats.json"


def load_reward_stats(model_dir: str) -> tuple[float, float]:
    """(mean, std) from ``model_dir/reward_stats.json``; a one-line ValueError if absent or unusable."""
    path = Path(model_dir) / REWARD_STATS_FILE
    try:
        stats = json.loads(path.read_text())
        mean, std = float(stats["mean"]), float(stats["std"])
    except FileNotFoundError:
        raise ValueError(f"reward.normalize is true but {path} does not exist; train the reward model with "
                         "python -m cluster.reward_model (it writes the file), or set reward.normalize=false") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"reward.normalize: {path} is unusable ({type_and_first_line(e)}); it needs numbers "
                         "'mean' and 'std'") from None
    if not (np.isfinite(mean) and np.isfinite(std) and std > 0):
        raise ValueError(f"reward.normalize: {path} has mean={mean}, std={std}; std must be a finite number > 0")
    return mean, std


class RewardModelScorer:
    """Scores token pairs with the reward model at ``model`` (a path or Hub id), on ``device``."""

    def __init__(self, model: str, *, dtype: torch.dtype, device: torch.device, batch_size: int,
                 packing: bool, normalize: bool) -> None:
        from transformers import AutoModelForSequenceClassification

        self.path = resolve_model_path(model, "Reward")
        self.name = f"reward model {self.path}"
        self.batch_size, self.packing, self.device = batch_size, packing, device
        try:
            m = load_pretrained(AutoModelForSequenceClassification, self.path, dtype=dtype)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"Reward: cannot load a sequence classifier from {self.path!r}: "
                             f"{type_and_first_line(e)}") from None
        if m.config.num_labels != 1:
            raise ValueError(f"Reward: {self.path!r} has num_labels={m.config.num_labels}; "
                             "a reward model needs exactly 1")
        # HF pools at the last token whose id != pad_token_id, which is wrong when pad == eos
        # and the response ends in eos; we run the body and apply the head at our own index.
        head = getattr(m, "score", None)
        if not isinstance(head, torch.nn.Module):
            raise ValueError(f"Reward: {type(m).__name__} at {self.path!r} has no `score` head; "
                             "only decoder-style sequence classifiers (last-token pooling) are supported")
        self.model = m.to(device).eval()
        self.model.requires_grad_(False)
        self._head = head
        if packing:  # a packed row attends per sequence where the family allows (else its mask keeps them apart)
            use_varlen(self.model)
        self._forward = self._forward_packed if packing else self._forward_padded
        try:
            tokenizer = load_tokenizer(self.path, "Reward")
        except ValueError:
            tokenizer = None
        self.pad_id = pad_token_id(tokenizer, m.config, "Reward")
        self.normalization = load_reward_stats(self.path) if normalize else None  # (mean, std)

    def score_tokens(self, prompts: list[np.ndarray], responses: list[np.ndarray]) -> ScoreResult:
        """One score per (prompt, response) pair of token arrays."""
        seqs = [np.concatenate([p, r]) for p, r in zip(prompts, responses)]
        for i, s in enumerate(seqs):
            if s.size == 0:
                raise ValueError(f"Reward.score: item {i} has no tokens (empty prompt and response)")
        raw = np.empty(len(seqs), dtype=np.float32)
        for rows in length_sorted_chunks([s.size for s in seqs], self.batch_size):
            raw[rows] = self._forward([seqs[i] for i in rows])
        if self.normalization is not None:  # the training responses' scores become mean 0, std 1
            mean, std = self.normalization
            raw = (raw - mean) / std
        return finalise(raw, self.name)

    def health(self) -> dict:
        dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        return {"model": self.path, "dtype": dtype, "packing": self.packing}

    @torch.inference_mode()
    def _forward_packed(self, seqs: list[np.ndarray]) -> np.ndarray:
        """The sequences as one packed row; the head at each sequence's last token."""
        row = pack_sequences(seqs, self.device)
        hidden = self.model.base_model(**row.inputs(self.model), use_cache=False).last_hidden_state  # [1, T, H]
        last = torch.from_numpy(row.ends - 1).to(self.device)
        return self._head(hidden[0, last]).float().squeeze(-1).cpu().numpy()

    @torch.inference_mode()
    def _forward_padded(self, seqs: list[np.ndarray]) -> np.ndarray:
        ids, mask = pad_right(seqs, self.pad_id)
        ids_t = torch.from_numpy(ids).to(self.device)
        mask_t = torch.from_numpy(mask).to(self.device)
        hidden = self.model.base_model(input_ids=ids_t, attention_mask=mask_t, use_cache=False).last_hidden_state
        return self._head(pool_last_token(hidden, mask_t)).float().squeeze(-1).cpu().numpy()

"""The reward model as one rank trains it: a sequence classifier on a causal-LM body,
fitted to (prompt, chosen, rejected) pairs with the Bradley-Terry loss (core/preference.py).

Scores are read where the Reward actor (actors/reward.py) reads them at PPO time: the
body's last hidden state at each sequence's last real token, through the ``score`` head.
HF's own pooling (last token whose id is not the pad id) would differ when pad == eos and
a response ends in eos, so the model trained here and the actor scoring with it agree by
construction rather than by luck.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import nn

from core.infra.dtypes import torch_dtype
from core.layout import pool_last_token
from core.modeling.architectures import load_pretrained
from core.modeling.packed_rows import PackedRow, pack_sequences
from core.modeling.varlen_attention import use_varlen
from core.preference import bradley_terry_loss
from learner import lora as adapters
from learner.lora_config import LoraConfig
from learner.objectives.objective import evaluating
from learner.objectives.sft import SupervisedObjective, collate_sequences
from learner.policy import HFWrapper, copy_tokenizer, disable_dropout

log = logging.getLogger(__name__)

Pair = tuple  # (prompt_ids [P], chosen_ids [C], rejected_ids [R]) int64 arrays


class RewardModule(HFWrapper):
    """An HF ``...ForSequenceClassification`` (num_labels=1) with last-real-token pooling."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        if getattr(model.config, "num_labels", 1) != 1 or not isinstance(getattr(model, "score", None), nn.Module):
            raise ValueError(f"RewardModule: {type(model).__name__} must be a decoder sequence classifier with "
                             "a `score` head and num_labels=1")
        self.model = model
        self.lora: Optional[LoraConfig] = None  # set when the body carries a LoRA adapter (learner/lora.py)
        disable_dropout(self)

    def forward(self, input_ids, attention_mask, packed: Optional[PackedRow] = None) -> torch.Tensor:
        """[B, T] right-padded ids and mask -> [B] float32 scores; or ``packed`` (input_ids and
        attention_mask None): the scores of its sequences, each at its last token."""
        if packed is not None:
            hidden = self.model.base_model(**packed.inputs(self.model), use_cache=False).last_hidden_state
            last = torch.from_numpy(packed.ends - 1).to(hidden.device)
            return self.model.score(hidden[0, last]).squeeze(-1).float()
        hidden = self.model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                       use_cache=False).last_hidden_state
        return self.model.score(pool_last_token(hidden, attention_mask)).squeeze(-1).float()

    def save_pretrained(self, out_dir, state_dict: Optional[dict] = None, *, with_lm: bool = True) -> Path:
        """An HF checkpoint AutoModelForSequenceClassification loads; tokenizer copied beside it.
        ``state_dict``: full tensors named as in ``state_dict()`` (gathered under ZeRO-3).
        With a LoRA adapter the model is written merged (in fp32) and the adapter alone under
        ``adapter/``; ``with_lm=False`` writes the adapter and the score head only."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = self.state_part("model.", state_dict)
        if self.lora is not None:
            adapter = adapters.adapter_state(state.items())
            adapter.update({adapters.PEFT_PREFIX + k: v for k, v in state.items() if k.startswith("score.")})
            adapters.write_adapter(adapters.adapter_files(adapter, self.lora, self.source_path, task="SEQ_CLS"),
                                   out / adapters.ADAPTER_DIR)
            state = adapters.merged_state(state, self.model) if with_lm else None
        if state is not None:
            self.model.save_pretrained(out, state_dict=state, safe_serialization=True)
        copy_tokenizer(self.source_path, out)
        return out

    @classmethod
    def from_pretrained(cls, path, *, dtype: str = "float32", pad_token_id: Optional[int] = None,
                        lora: Optional[LoraConfig] = None) -> "RewardModule":
        """A causal-LM checkpoint (the SFT model: its body is kept, a fresh ``score`` head is
        drawn from the current torch seed) or a reward-model checkpoint (kept whole). ``lora``
        (enabled): an adapter on the body's linear layers, the body frozen, the score head trained whole."""
        from transformers import AutoModelForSequenceClassification

        model = load_pretrained(AutoModelForSequenceClassification, str(path), num_labels=1,
                                                                   dtype=torch_dtype(dtype, "learner"))
        if model.config.pad_token_id is None and pad_token_id is not None:
            model.config.pad_token_id = pad_token_id  # HF's own forward needs it for batches > 1
        module = cls(model)
        module.source_path = str(path)
        if lora is not None and lora.enabled:
            adapters.add_adapter(model, lora, exclude=("score",))
            model.score.requires_grad_(True)
            module.lora = lora
        return module


class PreferenceObjective(SupervisedObjective):
    """Bradley-Terry on pairs: chosen and rejected of a micro-batch go through one forward."""

    name = "rm"

    @classmethod
    def load_module(cls, model: str, config) -> tuple:
        module = RewardModule.from_pretrained(model, lora=config.lora)
        if config.packing:  # packed rows attend per sequence, not over the whole row (where the family allows)
            use_varlen(module.model)
        return module, module.model

    def _forward(self, seqs: list[tuple]) -> torch.Tensor:
        """[n] float32 scores of (prompt_ids, response_ids) items: one packed row, or right-padded."""
        if self.config.packing:
            return self.engine(None, None, packed=pack_sequences([np.concatenate(s) for s in seqs], self.device))
        return self.engine(*collate_sequences(seqs, self.pad_id, self.device)[:2])

    def train(self, pairs: list[Pair], *, step: int = 0, margin: float = 0.0) -> dict:
        """One optimizer step per ``batch_size`` pairs (over all ranks); every rank calls it
        with its equal share. -> per-step global loss, accuracy, chosen-rejected gap, grad norm, lr."""
        out = {"loss": [], "accuracy": [], "gap": [], "grad_norm": [], "lr": []}
        for batch in self._batches(list(pairs)):
            n_global = len(batch) * self.world_size
            sums = np.zeros(3)  # loss, correct, gap

            def micro_loss(items, n_global=n_global, sums=sums):  # this batch's, bound now
                chosen, rejected = self._scores(items)
                loss = bradley_terry_loss(chosen, rejected, margin, normalizer=n_global)
                sums[:] += [float(loss.detach()), float((chosen > rejected).sum()),
                            float((chosen - rejected).detach().sum())]
                return loss

            done = self._optimizer_step(self._micro_batches(batch), micro_loss)
            loss, correct, gap = self.comm.sum(sums.tolist())
            out["loss"].append(loss)
            out["accuracy"].append(correct / n_global)
            out["gap"].append(gap / n_global)
            out["grad_norm"].append(done["grad_norm"])
            out["lr"].append(done["lr"])
        return out

    @evaluating
    def evaluate(self, pairs: list[Pair], *, margin: float = 0.0) -> dict:
        """Loss and pair accuracy over every rank's pairs (ranks may hold unequal shares)."""
        sums = np.zeros(3)  # loss sum, correct, pairs
        for items, weight in self._micro_batches(list(pairs), pad_to_ranks=True):
            chosen, rejected = self._scores(items)
            loss = bradley_terry_loss(chosen, rejected, margin, normalizer=1.0)
            sums += weight * np.array([float(loss), float((chosen > rejected).sum()), len(items)])
        loss, correct, n = self.comm.sum(sums.tolist())
        return {"loss": loss / n, "accuracy": correct / n, "pairs": int(n)}

    @evaluating
    def scores(self, sequences: list[tuple]) -> np.ndarray:
        """[N] float32 scores of (prompt_ids, response_ids) items; every rank calls it (through
        LearnerGroup.apply: a call of this objective's own)."""
        out = []
        for items, weight in self._micro_batches(list(sequences), pad_to_ranks=True):
            s = self._forward(items)
            if weight:
                out.append(s.cpu().numpy())
        return np.concatenate(out).astype(np.float32)

    def _scores(self, items: list[Pair]) -> tuple[torch.Tensor, torch.Tensor]:
        s = self._forward([(p, c) for p, c, _ in items] + [(p, r) for p, _, r in items])
        return s[:len(items)], s[len(items):]

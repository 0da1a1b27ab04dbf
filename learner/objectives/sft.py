"""Supervised fine-tuning of one data-parallel rank on the learner's DeepSpeed engine.

The module is PPO's (learner/policy.py: the policy with its value head); SFT reads
the LM logits and keeps the value head in the graph at zero weight, so ZeRO's gradient
reductions line up and the saved checkpoint is one cluster.train loads as it is.

Every rank gets an equal number of examples per optimizer step (the driver shards them).
Losses are normalised by GLOBAL counts, so the ranks' losses SUM to the batch loss;
DeepSpeed AVERAGES gradients over ranks, hence the loss is scaled by world_size before
backward (as in learner/objectives/ppo.py).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from core.layout import pad_right, position_ids
from core.preference import response_nll
from learner.objectives.objective import Objective, evaluating
from learner.packing import pack_examples
from learner.policy import PolicyWithValueHead

Example = tuple  # (prompt_ids [P] int64, response_ids [R] int64): one SFT example


def collate_sequences(parts: Sequence[Sequence[np.ndarray]], pad_id: int, device) -> tuple:
    """Right-padded concatenations: each item's arrays joined end to end.

    -> (input_ids [B, T] long, attention_mask [B, T] long, loss_mask [B, T] float), where
    loss_mask is 1 on the tokens of each item's LAST array (the response).
    """
    ids, attn = pad_right([np.concatenate(p).astype(np.int64) for p in parts], pad_id)
    loss_mask = torch.zeros(ids.shape, dtype=torch.float32)
    for row, p in enumerate(parts):
        n = sum(len(a) for a in p)
        loss_mask[row, n - len(p[-1]):n] = 1.0
    return torch.from_numpy(ids).to(device), torch.from_numpy(attn).to(device), loss_mask.to(device)


class SupervisedObjective(Objective):
    """What the SFT and reward-model objectives share: equal shards, micro-batches, one
    DeepSpeed optimizer step per batch, metrics reduced over the ranks."""

    def __init__(self, **parts) -> None:
        super().__init__(**parts)
        batch, self.micro = self.config.batch_sizes()
        self.local_batch = batch // self.world_size  # items per rank per optimizer step

    def _batches(self, items: list) -> list[list]:
        """This rank's items cut into optimizer steps; every rank must hold as many."""
        n = len(items)
        n_max, neg_n_min = self.comm.max([n, -n])
        if n_max != -neg_n_min or n == 0 or n % self.local_batch:
            raise ValueError(f"learner.{self.name}_train: ranks got unequal shards or a size that is not a multiple of "
                             f"the per-rank batch {self.local_batch} (rank {self.rank}: {n}, max {int(n_max)})")
        return [items[i:i + self.local_batch] for i in range(0, n, self.local_batch)]

    def _micro_batches(self, items: list, pad_to_ranks: bool = False) -> list[tuple[list, float]]:
        """(items, weight) per forward. ``pad_to_ranks``: ranks with fewer forwards repeat
        their first at weight 0, since under ZeRO-3 every forward is a collective."""
        micros = [(items[i:i + self.micro], 1.0) for i in range(0, len(items), self.micro)]
        if pad_to_ranks:
            (most,) = self.comm.max([len(micros)])
            if not micros:
                raise ValueError(f"learner rank {self.rank}: no items to evaluate; give every rank at least one")
            micros += [(micros[0][0], 0.0)] * (int(most) - len(micros))
        return micros

    def _optimizer_step(self, micros: list, micro_loss) -> dict:
        """Backward of ``micro_loss(items)`` (already globally normalised) for each micro-batch,
        then one optimizer step; -> lr and the gradient norm before clipping."""
        for i, (items, _) in enumerate(micros):
            self.engine.set_gradient_accumulation_boundary(i == len(micros) - 1)
            self.engine.backward(micro_loss(items) * self.world_size, scale_wrt_gas=False)
            if i < len(micros) - 1:
                self.engine.step()
        lr = self.engine.get_lr()[0]
        norm = None
        if self.engine.zero_optimization_stage() == 0:  # no norm recorded without ZeRO; grads are reduced now
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.engine.module.parameters()
                                                  if p.grad is not None])
        self.engine.step()
        norm = norm if norm is not None else self.engine.get_global_grad_norm()
        return {"lr": lr, "grad_norm": float(norm.item() if isinstance(norm, torch.Tensor) else
                                             (norm if norm is not None else float("nan")))}


class SFTObjective(SupervisedObjective):
    """Next-token loss on the response tokens of (prompt, response) examples."""

    name = "sft"

    def __init__(self, **parts) -> None:
        super().__init__(**parts)
        self._loss = self._packed_loss if self.config.packing else self._padded_loss

    @classmethod
    def load_module(cls, model: str, config) -> tuple:
        """The policy with a shared value head, which SFT keeps at zero weight (see above)."""
        policy = PolicyWithValueHead.from_pretrained(model, critic="shared", critic_model=None, lora=config.lora)
        if config.packing:  # packed rows attend per sequence, not over the whole row (where the family allows)
            policy.use_varlen()
        return policy, policy.lm

    def train(self, examples: list[Example], *, step: int = 0) -> dict:
        """One optimizer step per ``batch_size`` examples (over all ranks); every rank
        calls it with its equal share. -> per-step global losses, gradient norms, lr."""
        out = {"loss": [], "grad_norm": [], "lr": [], "tokens": 0}
        for batch in self._batches(list(examples)):
            (tokens,) = self.comm.sum([sum(len(r) for _, r in batch)])
            parts: list[float] = []

            def micro_loss(items, tokens=tokens, parts=parts):  # this batch's, bound now
                loss = self._loss(items, tokens)
                parts.append(float(loss.detach()))
                return loss

            done = self._optimizer_step(self._micro_batches(batch), micro_loss)
            (loss,) = self.comm.sum([sum(parts)])
            out["loss"].append(loss)
            out["grad_norm"].append(done["grad_norm"])
            out["lr"].append(done["lr"])
            out["tokens"] += int(tokens)
        return out

    @evaluating
    def evaluate(self, examples: list[Example]) -> dict:
        """Token-mean response loss over every rank's examples (ranks may hold unequal shares)."""
        total, tokens = 0.0, 0.0
        for items, weight in self._micro_batches(list(examples), pad_to_ranks=True):
            total += weight * float(self._loss(items, normalizer=1.0))
            tokens += weight * sum(len(r) for _, r in items)
        total, tokens = self.comm.sum([total, tokens])
        return {"loss": total / tokens, "tokens": int(tokens)}

    def _packed_loss(self, items: list[Example], normalizer: Optional[float]) -> torch.Tensor:
        """The micro-batch as one packed row (learner/packing.py): the response tokens' summed
        negative log-likelihood over ``normalizer`` (None: their count), as ``_padded_loss``."""
        packed = pack_examples(items, self.device)
        logprobs, values, _ = self.engine(packed.input_ids, None, packed.position_ids, packed=packed,
                                          with_entropy=False)
        count = float(len(packed.positions))
        return -logprobs.sum() / (count if normalizer is None else normalizer) + values.sum() * 0.0

    def _padded_loss(self, items: list[Example], normalizer: Optional[float]) -> torch.Tensor:
        ids, attn, loss_mask = collate_sequences(items, self.pad_id, self.device)
        logits, values = self.engine(ids, attn, position_ids(attn))
        # The value head joins the graph at zero weight so ZeRO's gradient reductions line up.
        return response_nll(logits.float(), ids, loss_mask, normalizer) + values.sum() * 0.0

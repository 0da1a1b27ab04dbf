"""The losses of the two stages PPO starts from: supervised fine-tuning and the reward model.

Pure tensor functions, no model or distributed state (the learner's SFT and reward-model
steps, learner/objectives/sft.py and learner/objectives/preference.py, call them).

    response_nll          SFT: next-token cross-entropy on response tokens only
    bradley_terry_loss    reward model: -log sigmoid(r_chosen - r_rejected - margin)
    pair_accuracy         reward model: how often the chosen response scores higher

Conventions as in core/masked.py: masks are 1 on counted positions and 0 elsewhere; shape
mismatches raise ValueError instead of broadcasting.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def _check_same_shape(fn: str, **tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"{fn}: shapes differ: {shapes}")


def response_nll(logits: Tensor, input_ids: Tensor, loss_mask: Tensor,
                 normalizer: Optional[float] = None) -> Tensor:
    """Summed next-token negative log-likelihood of the tokens ``loss_mask`` marks, divided
    by ``normalizer`` (default: how many it marks, i.e. the token mean).

    logits     [B, T, V]  the model's output on input_ids (logits[:, t] predicts input_ids[:, t+1])
    input_ids  [B, T]     prompt + response, right-padded
    loss_mask  [B, T]     1.0 where input_ids[:, t] is a response token to learn, 0 on the
                          prompt and padding; column 0 is never a target (nothing predicts it)
    -> scalar

    Only the response is learned: the prompt is given, not produced by the policy. A caller
    that splits a batch over micro-batches or ranks passes the GLOBAL token count as
    ``normalizer`` so the pieces sum to the batch's token mean.
    """
    fn = "response_nll"
    if logits.dim() != 3 or logits.shape[:2] != input_ids.shape:
        raise ValueError(f"response_nll: logits {tuple(logits.shape)} must be [B, T, V] over input_ids "
                         f"{tuple(input_ids.shape)}")
    _check_same_shape(fn, input_ids=input_ids, loss_mask=loss_mask)
    targets = loss_mask[:, 1:].to(logits.dtype)
    count = float(targets.sum())
    if normalizer is None:
        if count == 0:
            raise ValueError("response_nll: loss_mask marks no response token")
        normalizer = count
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1),
                          reduction="none").view_as(targets)
    # where(), not a product: a masked-out position's value never enters the sum, even NaN.
    return torch.where(targets != 0, nll * targets, 0.0).sum() / normalizer


def bradley_terry_loss(chosen: Tensor, rejected: Tensor, margin: Union[float, Tensor] = 0.0,
                       normalizer: Optional[float] = None) -> Tensor:
    """Bradley-Terry preference loss, summed over pairs and divided by ``normalizer``
    (default: the number of pairs, i.e. the mean).

    chosen, rejected  [B]  the reward model's scores of the preferred and the other response
    margin            scalar or [B]: how much higher the chosen score must be before the
                      loss stops pushing (0 = plain Bradley-Terry)
    -> scalar: sum_i -log sigmoid(chosen_i - rejected_i - margin_i) / normalizer

    d loss / d chosen_i = -sigmoid(-(chosen_i - rejected_i - margin_i)) / normalizer, and the
    opposite for rejected_i. logsigmoid keeps large negative differences finite.
    """
    fn = "bradley_terry_loss"
    if chosen.dim() != 1:
        raise ValueError(f"{fn}: scores must be 1-D [B], got {tuple(chosen.shape)}")
    _check_same_shape(fn, chosen=chosen, rejected=rejected)
    margin = torch.as_tensor(margin, dtype=chosen.dtype, device=chosen.device)
    if margin.dim() not in (0, 1) or (margin.dim() == 1 and margin.shape != chosen.shape):
        raise ValueError(f"{fn}: margin must be a scalar or [B]={tuple(chosen.shape)}, got {tuple(margin.shape)}")
    if normalizer is None:
        if chosen.numel() == 0:
            raise ValueError(f"{fn}: no pairs")
        normalizer = chosen.numel()
    return -F.logsigmoid(chosen - rejected - margin).sum() / normalizer


def pair_accuracy(chosen: Tensor, rejected: Tensor) -> Tensor:
    """[B], [B] -> scalar: the fraction of pairs whose chosen score is strictly higher
    (a tie counts as wrong: a model that scores everything alike has learned nothing)."""
    _check_same_shape("pair_accuracy", chosen=chosen, rejected=rejected)
    return (chosen > rejected).double().mean()

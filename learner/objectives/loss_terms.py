"""The terms of PPO's micro-batch loss: a table the loss sums, in order.

A term is one pure function of the micro-batch (the forward's outputs and the batch's
columns, [B, T] each: B rows, T response positions) and the update's settings. It returns
the term's value before its weight, then the diagnostics it reports. Its row in LOSS_TERMS
names where its weight comes from (None: the term is off for this update) and the
UpdateStats method that takes what the function returned. The loss adds the weighted terms
in the table's order: a floating-point sum depends on its order, so reordering the rows
changes the update's bits.

PTX is not a row: its rows are other text, with a backward of their own after the
minibatch's (the PTX step in learner/objectives/ppo.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from core import policy_losses, ppo
from core.kl import KLPenalty
from learner.batch import Batch
from learner.config import PPOConfig
from learner.objectives.stats import UpdateStats

Tensor = torch.Tensor


@dataclass(frozen=True)
class MicroBatch:
    """What the terms read of one micro-batch; every tensor [B, T]."""
    logprobs: Tensor        # log pi_theta of the sampled tokens, with their gradient
    values: Tensor          # the value head's, with their gradient
    entropy: Tensor         # the policy's entropy at each position, with its gradient
    batch: Batch            # the columns: old log-probs, advantages, off-policy weights, returns, reference...
    agg: ppo.Aggregation    # the update's: the global token and sequence counts, the horizon

    @property
    def mask(self) -> Tensor:
        return self.batch.response_mask


@dataclass(frozen=True)
class TermSettings:
    """What decides, for one update, each term's settings and weight."""
    ppo: PPOConfig
    kl: KLPenalty
    critic: bool            # a value model trains (ppo.advantage=gae)


def _ppo_loss(x: MicroBatch, p: PPOConfig) -> tuple[Tensor, Tensor, Tensor]:
    b = x.batch
    return ppo.policy_loss(x.logprobs, b.old_logprobs, b.advantages, x.mask, p.clip_low, p.clip_high,
                           p.dual_clip, x.agg, weights=b.is_weights)


def _gspo_loss(x: MicroBatch, p: PPOConfig) -> tuple[Tensor, Tensor, Tensor]:
    b = x.batch
    return policy_losses.gspo_loss(x.logprobs, b.old_logprobs, b.advantages, x.mask, p.clip_low, p.clip_high,
                                   x.agg, weights=b.is_weights)


def _cispo_loss(x: MicroBatch, p: PPOConfig) -> tuple[Tensor, Tensor, Tensor]:
    b = x.batch
    return policy_losses.cispo_loss(x.logprobs, b.old_logprobs, b.advantages, x.mask, p.clip_low, p.clip_high,
                                    x.agg, weights=b.is_weights)


# The policy losses by ``ppo.policy_loss`` (its names: core.choices.POLICY_LOSS_TABLE; a test checks
# they are the same), each of the [B, T] micro-batch against pi_old, each token weighted by its
# rollout correction's weight.
POLICY_LOSSES: dict[str, Callable[[MicroBatch, PPOConfig], tuple[Tensor, Tensor, Tensor]]] = {
    "ppo": _ppo_loss,      # core.ppo.policy_loss: the clipped token ratio
    "gspo": _gspo_loss,    # core.policy_losses.gspo_loss: the clipped sequence ratio
    "cispo": _cispo_loss,  # core.policy_losses.cispo_loss: the clipped, stop-gradient weight times log pi
}


def policy_term(x: MicroBatch, s: TermSettings) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, clip_frac, approx_kl), each []: ``ppo.policy_loss``'s loss of the [B, T] log-probs
    against pi_old, each token weighted by its off-policy weight."""
    return POLICY_LOSSES[s.ppo.policy_loss](x, s.ppo)


def value_term(x: MicroBatch, s: TermSettings) -> tuple[Tensor, Tensor]:
    """(loss, vf_clip_frac), each []: the clipped regression of the [B, T] values on the returns
    (core.ppo.value_loss)."""
    b = x.batch
    return ppo.value_loss(x.values, b.old_values, b.returns, x.mask, s.ppo.value_clip, x.agg)


def kl_term(x: MicroBatch, s: TermSettings) -> tuple[Tensor, Tensor]:
    """(loss, kl_mean), each []: the penalty's estimator of KL to the reference, its gradient
    through the [B, T] log-probs (core.ppo.kl_loss), and the estimate's token mean."""
    return ppo.kl_loss(x.logprobs, x.batch.reference_logprobs, x.mask, s.kl.estimator, x.agg)


def entropy_term(x: MicroBatch, s: TermSettings) -> tuple[Tensor]:
    """(loss,) []: minus the [B, T] entropy's aggregate, since the loss is minimised and the
    bonus is to raise the entropy."""
    return (-ppo.aggregate_loss(x.entropy, x.mask, x.agg),)


@dataclass(frozen=True)
class LossTerm:
    """A row of LOSS_TERMS: the term's function, its weight for an update (None: off) and the
    UpdateStats method that takes the function's outputs as floats (None: it reports nothing)."""
    name: str
    fn: Callable[[MicroBatch, TermSettings], tuple]
    weight: Callable[[TermSettings], Optional[float]]
    report: Optional[Callable[..., None]] = None


LOSS_TERMS: tuple[LossTerm, ...] = (
    LossTerm("policy", policy_term, weight=lambda s: 1.0, report=UpdateStats.add_policy),
    LossTerm("value", value_term, weight=lambda s: s.ppo.vf_coef if s.critic else None,
             report=UpdateStats.add_value),
    # Off when the KL is in the rewards; at beta 0 in the loss it still runs, so its metrics stay.
    LossTerm("kl", kl_term, weight=lambda s: s.kl.beta if s.kl.in_loss else None, report=UpdateStats.add_kl),
    LossTerm("entropy", entropy_term, weight=lambda s: s.ppo.entropy_coef or None),
)


def micro_batch_loss(x: MicroBatch, s: TermSettings, stats: UpdateStats, *, tokens: float,
                     terms: tuple[LossTerm, ...] = LOSS_TERMS) -> Tensor:
    """[] the weighted sum of the terms that are on, added in ``terms``' order; each term's
    outputs go to ``stats`` (``tokens``: the micro-batch's valid tokens, on this rank)."""
    loss = None
    for term in terms:
        weight = term.weight(s)
        if weight is None:
            continue
        out = term.fn(x, s)
        if term.report is not None:
            term.report(stats, *(t.item() for t in out), tokens=tokens)
        weighted = weight * out[0]
        loss = weighted if loss is None else loss + weighted
    return loss

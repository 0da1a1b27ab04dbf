"""What one rank accumulates over a PPO update, the metrics made from it, and their merge over the ranks."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable

import numpy as np

Reduce = Callable[[list], list]  # sums a list of local scalars over the ranks (Collectives.sum)


@dataclass
class UpdateStats:
    """Running sums over one ``train()`` call on one rank.

    Losses are summed per micro-batch: they are already normalised by GLOBAL token or
    sequence counts, so summing them over micro-batches and ranks gives the global loss
    of each optimizer step, summed over steps. Per-token statistics are weighted by this
    rank's token count so that their global sum divided by the global tokens is the mean.
    """
    policy_loss: float = 0.0     # sum of micro-batch policy losses
    value_loss: float = 0.0      # sum of micro-batch value losses
    ptx_loss: float = 0.0        # sum of this rank's PTX token-mean LM losses, one per step
    kl_loss: float = 0.0         # sum of micro-batch KL loss terms (before beta; ppo.kl.placement=loss)
    kl_sum: float = 0.0          # the KL loss's per-token estimate x tokens
    entropy_sum: float = 0.0     # sum of per-token entropies
    approx_kl_sum: float = 0.0   # approx_kl x tokens, per micro-batch
    clip_sum: float = 0.0        # clip_frac x tokens
    vf_clip_sum: float = 0.0     # vf_clip_frac x tokens
    tokens: float = 0.0          # valid response tokens seen (each epoch counts again)
    grad_norm_sum: float = 0.0   # pre-clip global gradient norm, summed over optimizer steps
    optimizer_steps: int = 0
    fed: float = 0.0             # positions the update's forwards ran on, padding included
    real: float = 0.0            # of which real tokens (prompt + response)
    lr: float = 0.0              # the learning rate of the last optimizer step

    def add_micro_batch(self, *, entropy_sum: float, tokens: float) -> None:
        """The micro-batch's forward: its entropy and tokens, whichever loss terms are on."""
        self.entropy_sum += entropy_sum
        self.tokens += tokens

    # The loss terms' reports (learner/objectives/loss_terms.py): each takes what its term's
    # function returns, in order; a token mean is weighted by the micro-batch's tokens.
    def add_policy(self, loss: float, clip_frac: float, approx_kl: float, *, tokens: float) -> None:
        self.policy_loss += loss
        self.clip_sum += clip_frac * tokens
        self.approx_kl_sum += approx_kl * tokens

    def add_value(self, loss: float, vf_clip_frac: float, *, tokens: float) -> None:
        self.value_loss += loss
        self.vf_clip_sum += vf_clip_frac * tokens

    def add_kl(self, loss: float, kl_mean: float, *, tokens: float) -> None:
        self.kl_loss += loss
        self.kl_sum += kl_mean * tokens

    def add_optimizer_step(self, *, grad_norm: float, lr: float) -> None:
        self.grad_norm_sum += grad_norm
        self.optimizer_steps += 1
        self.lr = lr

    def add_forward(self, *, fed: float, real: float) -> None:
        self.fed += fed
        self.real += real

    def copy(self) -> "UpdateStats":
        return replace(self)

    def since(self, before: "UpdateStats") -> "UpdateStats":
        """What was added after the snapshot ``before`` (one epoch's share)."""
        return UpdateStats(**{f.name: getattr(self, f.name) - getattr(before, f.name) for f in fields(self)})

    def epoch_summary(self) -> dict:
        """This rank's per-epoch loss and clip statistics (PPOObjective.epoch_history)."""
        steps, tokens = max(self.optimizer_steps, 1), max(self.tokens, 1)
        return {"policy_loss": self.policy_loss / steps, "value_loss": self.value_loss / steps,
                "clip_frac": self.clip_sum / tokens, "approx_kl": self.approx_kl_sum / tokens}

    def metrics(self, reduce: Reduce, *, world_size: int, with_ptx: bool, with_kl_loss: bool = False,
                with_values: bool = True) -> dict:
        """The ``ppo/*`` metrics over all ranks (one all-reduce; every rank must call)."""
        pg, vf, ptx, ent, kl, clip, vf_clip, tokens, kl_loss, kl_in_loss, fed, real = reduce(
            [self.policy_loss, self.value_loss, self.ptx_loss, self.entropy_sum, self.approx_kl_sum,
             self.clip_sum, self.vf_clip_sum, self.tokens, self.kl_loss, self.kl_sum, self.fed, self.real])
        steps = max(self.optimizer_steps, 1)  # the same on every rank
        out = {"ppo/policy_loss": pg / steps, "ppo/value_loss": vf / steps,
               "ppo/entropy": ent / tokens, "ppo/approx_kl": kl / tokens, "ppo/clip_frac": clip / tokens,
               "ppo/vf_clip_frac": vf_clip / tokens, "ppo/grad_norm": self.grad_norm_sum / steps,
               "ppo/lr": self.lr, "perf/learner_padding_frac": 1.0 - real / fed if fed else 0.0}
        if not with_values:  # no critic: nothing was regressed
            del out["ppo/value_loss"], out["ppo/vf_clip_frac"]
        if with_ptx:
            out["ppo/ptx_loss"] = ptx / (steps * world_size)
        if with_kl_loss:
            out["ppo/kl_loss"] = kl_loss / steps
            out["ppo/kl_loss_token_mean"] = kl_in_loss / tokens
        return out


def merge_rank_metrics(per_rank: list[dict]) -> dict:
    """One metrics dict from the ranks' train(): they all-reduce already, so values agree; the
    mean for safety, lr from rank 0, the slowest rank's time, and each rank's own transfer/*
    (bytes, seconds of taking its shard) summed."""
    out = {}
    for key in per_rank[0]:
        values = [m[key] for m in per_rank]
        if key == "ppo/lr":
            out[key] = values[0]
        elif key == "perf/learner_seconds":
            out[key] = max(values)
        elif key.startswith("transfer/"):
            out[key] = sum(values)
        else:
            out[key] = float(np.mean(values))
    return out

"""What a learner rank trains: one objective on the rank's DeepSpeed engine.

A LearnerWorker (learner/worker.py) owns the engine, the step counter and exactly one
objective; the recipe picks the objective's class where it builds the LearnerGroup: PPO
(learner/objectives/ppo.py), SFT (learner/objectives/sft.py) or a reward model on preference pairs
(learner/objectives/preference.py). Every objective answers ``train(batch)`` and ``evaluate(batch)``
on its rank's share of the batch (every rank calls, since the ranks meet in collectives);
the class says which module the engine wraps, and how the group hands each rank its
options and merges what the ranks return.
"""
from __future__ import annotations

import functools
from typing import ClassVar

import torch

from learner.collectives import Collectives
from learner.config import RankConfig


class Objective:
    """The interface, with the parts every objective keeps: the engine, this rank's place
    among the ranks, their collectives, its device and the pad id."""

    name: ClassVar[str]  # names the calls in messages ("learner.{name}_train: ...")

    def __init__(self, *, engine, config: RankConfig, rank: int, world_size: int,
                 collectives: Collectives, device: torch.device, pad_id: int) -> None:
        self.engine, self.config = engine, config
        self.rank, self.world_size = rank, world_size
        self.comm, self.device, self.pad_id = collectives, device, pad_id

    @classmethod
    def load_module(cls, model: str, config: RankConfig) -> tuple:
        """(the module the engine wraps, its Hugging Face body), loaded from ``model``; the
        torch seed is set already, so a fresh head is drawn alike on every rank."""
        raise NotImplementedError

    def train(self, batch, *, step: int, **options) -> dict:
        """Optimizer steps on this rank's share; ``step``: the worker's completed train() calls."""
        raise NotImplementedError

    def evaluate(self, batch, **options):
        """This rank's share under the current weights, no step taken."""
        raise NotImplementedError

    @classmethod
    def rank_options(cls, world_size: int, **options) -> list[dict]:
        """Each rank's options of a group's train() call: the same for every rank unless an
        objective splits one (PPO's PTX rows)."""
        return [options] * world_size

    @classmethod
    def merge_train(cls, per_rank: list[dict]) -> dict:
        """One result from the ranks' train(): they reduce over the ranks inside, so rank 0's
        stands for all."""
        return per_rank[0]

    @classmethod
    def merge_evaluate(cls, per_rank: list):
        """One result from the ranks' evaluate(), as merge_train."""
        return per_rank[0]


def evaluating(method):
    """An objective's method that only scores (held-out loss, reward scores): run without
    gradients and with the module in eval mode, its modes restored after. disable_dropout zeroes
    the base model's dropout, but a LoRA adapter's dropout (learner.lora.dropout, the stages'
    regulariser) is added after it and stays live in train mode: the same inputs would score
    differently on every call, and reward_stats.json would be built from noisy scores."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        modes = [(m, m.training) for m in self.engine.module.modules()]
        self.engine.module.eval()
        try:
            with torch.no_grad():
                return method(self, *args, **kwargs)
        finally:
            for module, training in modes:
                module.training = training
    return wrapper

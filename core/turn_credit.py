"""Credit per turn for the group estimators: episodes rewarded turn by turn
(env.reward_placement=turn) compare each turn's return with the same turn of the other samples
of their prompt.

A turn is a run of the policy's tokens in a transcript (mask 1 between environment tokens).
Its return is its own reward plus every later turn's (the rewards as they entered the rewards:
clipped, the truncation penalty on the last token; undiscounted, as the outcome estimators are).
The group estimators baseline the return of turn k against the returns of turn k of the group's
other samples that reached a turn k, and every token of turn k gets that advantage. So a group
whose samples earned the same rewards turn by turn gets 0 everywhere, and a difference that
first appears at turn k moves the credit of turn k and later ones only: turn-level credit as in
MT-GRPO (Zeng et al. 2025, "Reinforcing Multi-Turn Reasoning in LLM Agents via Turn-Level Credit
Assignment"), with returns in place of single-turn rewards so that a turn which earns nothing
itself (a tool call) is credited for the turns it made possible.
Conventions as in core.masked.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from core.masked import check_masked

Tensor = torch.Tensor


class TurnUnits(NamedTuple):
    """Every turn of a batch's rows, [U] each: its row, its index in the row (0-based), the
    columns of its first and last token and its return (float64)."""
    row: Tensor
    turn: Tensor
    first: Tensor
    last: Tensor
    returns: Tensor


def turn_index(mask: Tensor) -> Tensor:
    """[B, T] int64: each valid token's turn in its row (0-based; the k-th run of valid columns),
    -1 on masked columns."""
    valid = mask != 0
    before = torch.nn.functional.pad(valid[:, :-1], (1, 0), value=False)
    index = torch.cumsum((valid & ~before).to(torch.int64), dim=1) - 1
    return torch.where(valid, index, torch.full_like(index, -1))


def turn_units(placed: Tensor, mask: Tensor) -> TurnUnits:
    """The turns of ``mask`` [B, T] with their returns: the sums of ``placed`` [B, T] (each turn's
    reward on its last token) from each turn's first token to the row's end. Rows in order, turns
    in order within a row."""
    check_masked("turn_units", mask, placed=placed)
    valid = mask != 0
    index = turn_index(mask)
    before = torch.nn.functional.pad(valid[:, :-1], (1, 0), value=False)
    after = torch.nn.functional.pad(valid[:, 1:], (0, 1), value=False)
    row, first = (valid & ~before).nonzero(as_tuple=True)
    _, last = (valid & ~after).nonzero(as_tuple=True)
    # the sum from each column to the row's end, in float64 (a tail sum, so no cancellation)
    tail = torch.flip(torch.cumsum(torch.flip(torch.where(valid, placed.double(), 0.0), [1]), 1), [1])
    return TurnUnits(row=row, turn=index[row, first], first=first, last=last, returns=tail[row, first])


def unit_groups(group: Tensor, turn: Tensor, population_group: Tensor,
                population_turn: Tensor) -> tuple[Tensor, Tensor]:
    """(ids [U], population ids [N]) int64: one id per (group, turn index) pair, the same pair the
    same id on both sides, so turn k is baselined against its group's turns k only."""
    pairs = torch.stack([torch.cat([population_group, group]), torch.cat([population_turn, turn])], dim=1)
    _, ids = torch.unique(pairs, dim=0, return_inverse=True)
    return ids[population_group.numel():], ids[:population_group.numel()]


def on_turn_tokens(units: TurnUnits, advantages: Tensor, mask: Tensor) -> Tensor:
    """[B, T] float64: each valid token of ``mask`` [B, T] holds its turn's advantage (``advantages``
    [U], in ``units``' order), 0 on masked columns."""
    index = turn_index(mask)
    if advantages.numel() == 0:
        return torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    per_row = torch.bincount(units.row, minlength=mask.shape[0])
    start = torch.cumsum(per_row, 0) - per_row  # each row's first unit
    unit = (start[:, None] + index).clamp(min=0)
    return torch.where(index >= 0, advantages.double()[unit], torch.zeros((), dtype=torch.float64))

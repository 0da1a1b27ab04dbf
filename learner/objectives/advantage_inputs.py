"""A learner rank's shard as an estimator's input (core.estimators.AdvantageInputs): the scores
as they entered the rewards, each row's group (its prompt, the same id on every rank) and, for the
group estimators, the whole batch's scores, gathered from every rank since a prompt's samples may
sit on several. Rows rewarded turn by turn (env.reward_placement=turn) bring their placed rewards,
and the group estimators then compare turns: every rank's (group, turn, return) is gathered.
"""
from __future__ import annotations

from typing import Optional

import torch

from core.advantages import last_valid_column
from core.estimators import AdvantageInputs
from core.rollout import ScoredRollout
from core.turn_credit import turn_units
from learner.batch import Batch
from learner.collectives import Collectives


def advantage_inputs(batch: Batch, shard: list[ScoredRollout], *, comm: Collectives, row_offset: int,
                     device: torch.device, with_population: bool,
                     values: Optional[torch.Tensor] = None) -> AdvantageInputs:
    """The estimator's input for ``shard`` (collated as ``batch``); ``row_offset``: this rank's first
    row in the gathered batch; ``with_population``: gather every rank's scores (group estimators)."""
    mask = batch.response_mask
    # Each score as it entered the rewards, no KL: the estimators add the KL penalty themselves.
    scores = torch.tensor([r.reward_score for r in shard], dtype=torch.float64)
    keys = [(r.chunk_id, r.prompt_index) if r.chunk_id >= 0 else (-1, -1) for r in shard]
    placed = population = turn_population = None
    # Every rank must take the same path (their gathers meet): turns if any rank's rows have them.
    if with_population and comm.max([float(any(r.placed_rewards is not None for r in shard))])[0] > 0:
        placed = placed_rewards(shard, mask)
    if with_population and placed is None:
        everyone = torch.tensor(comm.gather_rows([(*k, s) for k, s in zip(keys, scores.tolist())]),
                                dtype=torch.float64)
        population = (everyone[:, 2].to(device), group_ids(everyone[:, :2].long().tolist(), offset=0).to(device))
    elif with_population:
        turn_population = _turn_population(keys, placed, mask, comm=comm, row_offset=row_offset, device=device)
    return AdvantageInputs(rewards=batch.rewards, scores=scores.to(device), mask=mask,
                           group=group_ids(keys, offset=row_offset).to(device), values=values,
                           population=population, placed=placed, turn_population=turn_population)


def group_ids(keys: list, offset: int) -> torch.Tensor:
    """[n] int64 group ids from (chunk id, prompt index) pairs: one per prompt, the same on
    every rank. A row with no chunk (-1, -1) is a group of its own, told apart by its row
    (``offset``: the row's position in the gathered batch less its index here)."""
    return torch.tensor([_group_id(c, p, offset + i) for i, (c, p) in enumerate(keys)], dtype=torch.int64)


def _group_id(chunk, prompt, row: int) -> int:
    """One prompt's id (chunk id, prompt index), or for a row with no chunk its gathered position."""
    return (int(chunk) << 32) + int(prompt) if chunk >= 0 else -1 - int(row)


def placed_rewards(shard: list[ScoredRollout], mask: torch.Tensor) -> torch.Tensor:
    """[B, R] the turn rewards as they entered the rewards (ScoredRollout.placed_rewards; a row
    rewarded as a whole: its score on its last token, one turn)."""
    out = torch.zeros(mask.shape, dtype=torch.float32)
    last = last_valid_column(mask.cpu())
    for row, r in enumerate(shard):
        if r.placed_rewards is not None:
            out[row, :r.placed_rewards.size] = torch.tensor(r.placed_rewards)
        elif int(last[row]) >= 0:
            out[row, int(last[row])] = r.reward_score
    return out.to(mask.device)


def _turn_population(keys: list, placed: torch.Tensor, mask: torch.Tensor, *, comm: Collectives,
                     row_offset: int, device: torch.device):
    """(returns [N], group [N], turn [N]) of every rank's turns (core.turn_credit.turn_units), each
    turn's group id as ``group_ids`` gives its row's."""
    units = turn_units(placed, mask)
    mine = [(*keys[int(r)], row_offset + int(r), int(k), float(g))
            for r, k, g in zip(units.row.tolist(), units.turn.tolist(), units.returns.tolist())]
    everyone = torch.tensor(comm.gather_rows(mine), dtype=torch.float64)
    ids = [_group_id(c, p, row) for c, p, row in everyone[:, :3].tolist()]
    return (everyone[:, 4].to(device), torch.tensor(ids, dtype=torch.int64, device=device),
            everyone[:, 3].long().to(device))

"""Advantage estimators, by name: GAE with a critic, and the critic-free family that
baselines each sample against the other samples of its prompt (its group) or the batch.

Every estimator takes one ``AdvantageInputs`` and returns ``(advantages, returns)``, both
[B, T], detached, 0 on padding; ``returns`` is None for the critic-free ones (there is no
value to regress). Conventions as in core.masked. Which estimators exist, and what each needs,
is core.choices.ESTIMATOR_TABLE; ``ESTIMATORS`` maps each name to its row and function, and
``estimator(name)`` refuses an unknown one listing the valid names.

A group is the samples of one prompt (``generator.sampling.n`` of them); ``group`` [B]
holds each row's group id. A group of one sample has no baseline to compare with: its
baseline is 0 (its advantage is its own reward), as verl does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, NamedTuple, Optional, Tuple

import torch

from core.advantages import gae, last_valid_column
from core.choices import ESTIMATOR_TABLE, EstimatorRow, estimator_row
from core.masked import check_masked, check_shapes, local_sums, require, whiten, zero_pad
from core.turn_credit import on_turn_tokens, turn_units, unit_groups

Tensor = torch.Tensor


@dataclass(frozen=True)
class AdvantageInputs:
    """One batch's material for an estimator.

    rewards: [B, T] dense per-token rewards (core.advantages.per_token_rewards): -beta x the
        per-token KL when the KL is in the reward (else 0), plus ``scores`` on the last valid token;
    scores: [B] each sequence's score as it enters its rewards (clipped, plus any truncation
        penalty; no KL): what the group estimators compare;
    mask: [B, T] valid response tokens; group: [B] int64 group id per row (its prompt);
    values: [B, T] the critic's values (GAE only), else None;
    population: (scores [N], group [N]) of the whole batch when these rows are one rank's
        share of it (their own among them): group statistics are taken over it. None: these
        rows are the whole batch.
    placed: [B, T] rows rewarded turn by turn (env.reward_placement=turn): their shaped rewards as
        they sit in ``rewards`` (each turn's on its last token); the group estimators then credit
        each turn by its return (core/turn_credit.py). None: each score on its row's last token.
    turn_population: (returns [N] float64, group [N], turn [N]) every turn of the whole batch
        (core.turn_credit.turn_units) when these rows are one rank's share; None: these rows.
    """
    rewards: Tensor
    scores: Tensor
    mask: Tensor
    group: Tensor
    values: Optional[Tensor] = None
    population: Optional[Tuple[Tensor, Tensor]] = None
    placed: Optional[Tensor] = None
    turn_population: Optional[Tuple[Tensor, Tensor, Tensor]] = None


@dataclass(frozen=True)
class EstimatorOptions:
    gamma: float = 1.0
    lam: float = 0.95
    scale_by_std: bool = True   # grpo: divide by the group's std (false: Dr. GRPO)
    whiten_gae: bool = True     # gae: whiten the advantages over the batch (ppo.whiten_advantages)
    eps: float = 1e-6


def batch_whiten(x: Tensor, mask: Tensor, reduce=local_sums) -> Tensor:
    """``x`` whitened over the whole batch in float64 (its statistics are sums over every
    rank's rows when ``reduce`` all-reduces), back in ``x``'s dtype."""
    return whiten(x.double(), mask, reduce=reduce).to(x.dtype)


Result = Tuple[Tensor, Optional[Tensor]]
# (scores [U], group [U], population or None) -> [U] float64: an outcome estimator's advantage of
# each score against its group
ScoreAdvantage = Callable[[Tensor, Tensor, Optional[Tuple[Tensor, Tensor]]], Tensor]


class GroupStats(NamedTuple):
    """Each row's group over the population, [B] float64 each: its size, the mean and the sum of
    squares about it of its scores, and whether its scores are all equal (``flat``)."""
    count: Tensor
    mean: Tensor
    squares: Tensor
    flat: Tensor


def group_stats(scores: Tensor, group: Tensor, population=None) -> GroupStats:
    """The statistics of each row's group over ``population`` (scores [N], group [N]; these rows
    among them), or over the rows themselves when it is None. In float64: n float32 copies of
    a score such as 3.3 sum to a mean a rounding step off it, and a std above 0."""
    pop_scores, pop_group = population if population is not None else (scores, group)
    check_shapes("group statistics", "population scores", pop_scores.shape, group=pop_group)
    _, index = torch.unique(torch.cat([pop_group, group]), return_inverse=True)
    pop, rows = index[:pop_group.numel()], index[pop_group.numel():]
    size = int(index.max()) + 1
    pop_scores = pop_scores.to(device=scores.device, dtype=torch.float64)
    count = torch.zeros(size, dtype=torch.float64, device=scores.device).index_add(0, pop, torch.ones_like(pop_scores))
    mean = torch.zeros_like(count).index_add(0, pop, pop_scores) / count.clamp(min=1)
    squares = torch.zeros_like(count).index_add(0, pop, (pop_scores - mean[pop]) ** 2)
    low = torch.full_like(count, math.inf).scatter_reduce(0, pop, pop_scores, "amin")
    high = torch.full_like(count, -math.inf).scatter_reduce(0, pop, pop_scores, "amax")
    return GroupStats(count[rows], mean[rows], squares[rows], (low == high)[rows])


def group_baseline(scores: Tensor, group: Tensor, *, leave_one_out: bool, population=None) -> Tuple[Tensor, Tensor]:
    """(baseline [B], group size [B]), float64: each row's group mean of ``scores`` [B], or with
    ``leave_one_out`` the mean of the OTHER rows of its group; 0 for a group of one. A group
    whose scores are all equal has its score as the baseline exactly, so its samples get 0.
    ``population``: the (scores [N], group [N]) the groups are taken over, these rows included."""
    check_shapes("group_baseline", "scores", scores.shape, group=group)
    g = group_stats(scores, group, population)
    s = scores.double()
    if leave_one_out:
        baseline = torch.where(g.count > 1, (g.mean * g.count - s) / (g.count - 1).clamp(min=1), torch.zeros_like(s))
    else:
        baseline = torch.where(g.count > 1, g.mean, torch.zeros_like(s))
    return torch.where(g.flat & (g.count > 1), s, baseline), g.count


def group_std(scores: Tensor, group: Tensor, population=None) -> Tensor:
    """[B] float64 the unbiased standard deviation of each row's group (1 for a group of one,
    exactly 0 for a group whose scores are all equal)."""
    g = group_stats(scores, group, population)
    std = torch.where(g.count > 1, (g.squares / (g.count - 1).clamp(min=1)).sqrt(), torch.ones_like(g.mean))
    return torch.where(g.flat & (g.count > 1), torch.zeros_like(std), std)


def returns_to_go(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """[B, T] the discounted sum of ``rewards`` [B, T] from each valid token to the row's end;
    masked columns inside a row are skipped (gamma counts valid tokens), 0 there."""
    r = zero_pad(rewards.detach(), mask)
    valid = mask != 0
    running = torch.zeros_like(r[:, 0])
    out = [None] * r.shape[1]
    for t in reversed(range(r.shape[1])):
        running = torch.where(valid[:, t], r[:, t] + gamma * running, running)
        out[t] = running
    return zero_pad(torch.stack(out, dim=1), mask)


def _check(fn: str, x: AdvantageInputs) -> None:
    check_masked(fn, x.mask, rewards=x.rewards)
    check_shapes(fn, "mask rows", x.mask.shape[:1], scores=x.scores, group=x.group)


def gae_advantages(x: AdvantageInputs, opt: EstimatorOptions, reduce=local_sums) -> Result:
    """GAE on the critic's values (core.advantages.gae), then whitened over the batch."""
    require(x.values is not None, "gae: needs the critic's values (learner.critic shared or separate)")
    adv, ret = gae(x.rewards, x.values, x.mask, opt.gamma, opt.lam)
    return (batch_whiten(adv, x.mask, reduce) if opt.whiten_gae else adv), ret


def score_with_kl_penalty(x: AdvantageInputs, shaped: Tensor) -> Tensor:
    """[B, T] float32: the returns-to-go of ``shaped`` [B] (each row's score after its group's
    baseline) on the row's last valid token plus the per-token KL penalty of ``x.rewards``
    (x.rewards less x.scores on the last token; 0 when the KL is in the loss). The group
    statistics see the score alone, so beta keeps its meaning whatever the group's spread
    (OpenRLHF's rloo / group_norm / reinforce_baseline; REINFORCE++'s per-token KL). Undiscounted:
    an outcome is the whole sequence's, so every token shares it (verl's GRPO ignores gamma,
    OpenRLHF sets it to 1)."""
    rows = torch.arange(x.mask.shape[0], device=x.mask.device)
    last = last_valid_column(x.mask).clamp(min=0)  # a row without tokens: its zeros stay zeros
    rewards = zero_pad(x.rewards.detach().to(torch.float32), x.mask)
    # In the rewards' own precision: the score on the last token cancels exactly.
    kl_penalty = rewards.index_put((rows, last), -x.scores.detach().to(torch.float32), accumulate=True)
    dense = kl_penalty.index_put((rows, last), shaped.to(torch.float32), accumulate=True)
    return returns_to_go(dense, x.mask)


def turns_with_kl_penalty(x: AdvantageInputs, score_advantage: ScoreAdvantage) -> Tensor:
    """[B, T] float32: each token of turn k its turn's return baselined by ``score_advantage``
    against the turns k of its group (core/turn_credit.py), plus the KL penalty's returns-to-go
    (``x.rewards`` less ``x.placed``)."""
    units = turn_units(x.placed.detach(), x.mask)
    group = x.group[units.row]
    if x.turn_population is None:
        pop_returns, pop_group, pop_turn = units.returns, group, units.turn
    else:
        pop_returns, pop_group, pop_turn = x.turn_population
    ids, pop_ids = unit_groups(group, units.turn, pop_group.to(group.device), pop_turn.to(group.device))
    adv = score_advantage(units.returns, ids, (pop_returns, pop_ids))
    kl_penalty = zero_pad(x.rewards.detach().to(torch.float32) - x.placed.detach().to(torch.float32), x.mask)
    return (returns_to_go(kl_penalty, x.mask).double() + on_turn_tokens(units, adv, x.mask)).to(torch.float32)


def outcome_with_kl_penalty(x: AdvantageInputs, score_advantage: ScoreAdvantage) -> Tensor:
    """[B, T] float32 the advantages of an outcome estimator: ``score_advantage`` of each row's
    score (``score_with_kl_penalty``), or of each turn's return when the rows are rewarded turn by
    turn (``turns_with_kl_penalty``)."""
    if x.placed is not None:
        return turns_with_kl_penalty(x, score_advantage)
    return score_with_kl_penalty(x, score_advantage(x.scores.detach(), x.group, x.population))


def grpo_score_advantage(scores: Tensor, group: Tensor, population, scale_by_std: bool, eps: float) -> Tensor:
    """[B] float64 (score - group mean) / (group std + eps); without ``scale_by_std`` the mean
    only (Dr. GRPO). A group whose scores are all equal gets 0."""
    mean, _ = group_baseline(scores, group, leave_one_out=False, population=population)
    adv = scores.double() - mean
    if scale_by_std:  # equal scores: nothing to learn, 0 (not 0 / 0)
        std = group_std(scores, group, population)
        adv = torch.where(std > 0, adv / (std + eps), torch.zeros_like(adv))
    return adv


def grpo_advantages(x: AdvantageInputs, opt: EstimatorOptions, reduce=local_sums) -> Result:
    """(score - group mean) / (group std + eps), then the KL penalty's returns-to-go added
    (``outcome_with_kl_penalty``); without ``scale_by_std`` only the mean is taken off (Dr. GRPO).
    A group whose scores are all equal gets 0 from its score."""
    _check("grpo", x)
    return outcome_with_kl_penalty(x, partial(grpo_score_advantage, scale_by_std=opt.scale_by_std,
                                              eps=opt.eps)), None


def leave_one_out_advantage(scores: Tensor, group: Tensor, population) -> Tensor:
    """[B] float64 each score less the mean score of its group's other samples."""
    baseline, _ = group_baseline(scores, group, leave_one_out=True, population=population)
    return scores.double() - baseline


def mean_baseline_advantage(scores: Tensor, group: Tensor, population) -> Tensor:
    """[B] float64 each score less its group's mean score."""
    mean, _ = group_baseline(scores, group, leave_one_out=False, population=population)
    return scores.double() - mean


def rloo_advantages(x: AdvantageInputs, opt: EstimatorOptions, reduce=local_sums) -> Result:
    """score minus the mean score of the group's other samples, then the KL penalty's
    returns-to-go added (``outcome_with_kl_penalty``)."""
    _check("rloo", x)
    return outcome_with_kl_penalty(x, leave_one_out_advantage), None


def reinforce_pp_advantages(x: AdvantageInputs, opt: EstimatorOptions, reduce=local_sums) -> Result:
    """REINFORCE++: the returns-to-go of the dense rewards (KL per token, score at the end),
    whitened over the whole batch (``reduce``: over every rank's rows)."""
    _check("reinforce_pp", x)
    return batch_whiten(returns_to_go(x.rewards, x.mask, opt.gamma), x.mask, reduce), None


def reinforce_pp_baseline_advantages(x: AdvantageInputs, opt: EstimatorOptions, reduce=local_sums) -> Result:
    """REINFORCE++-baseline (Hu et al. 2025; OpenRLHF's reinforce_baseline): the group's mean
    score taken off each score, the KL penalty's returns-to-go added (``outcome_with_kl_penalty``),
    then whitened over the whole batch as reinforce_pp."""
    _check("reinforce_pp_baseline", x)
    return batch_whiten(outcome_with_kl_penalty(x, mean_baseline_advantage), x.mask, reduce), None


@dataclass(frozen=True)
class Estimator:
    """A row of core.choices.ESTIMATOR_TABLE with its function."""
    row: EstimatorRow
    fn: Callable[..., Result]

    @property
    def needs_critic(self) -> bool:
        return self.row.needs_critic

    @property
    def uses_groups(self) -> bool:
        return self.row.uses_groups


ESTIMATORS = {row.name: Estimator(row=row, fn=globals()[row.function]) for row in ESTIMATOR_TABLE}


def estimator(name: str) -> Estimator:
    """The estimator called ``name``; a one-line error listing the valid names otherwise."""
    return ESTIMATORS[estimator_row(name).name]

"""Advantage estimators, by name: GAE with a critic, and the critic-free family that
baselines each sample against the other samples of its prompt (its group) or the batch.

Every estimator takes one ``AdvantageInputs`` and returns ``(advantages, returns)``, both
[B, T], detached, 0 on padding; ``returns`` is None for the critic-free ones (there is no
value to regress). Conventions as in core.masked. ``ESTIMATORS`` maps a config name to its
``Estimator``; ``estimator(name)`` refuses an unknown one listing the valid names.

A group is the samples of one prompt (``generator.sampling.n`` of them); ``group`` [B]
holds each row's group id. A group of one sample has no baseline to compare with: its
baseline is 0 (its advantage is its own reward), as verl does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from core.advantages import gae
from core.layout import last_token_index
from core.masked import check_masked, check_shapes, local_sums, require, whiten, zero_pad

Tensor = torch.Tensor


@dataclass(frozen=True)
class AdvantageInputs:
    """One batch's material for an estimator.

    rewards: [B, T] dense per-token rewards (core.advantages.per_token_rewards: the score on
        the last valid token, minus beta x the per-token KL when the KL is in the reward);
    scores: [B] each sequence's return: the sum of its rewards (the score, less the KL penalty
        when the KL is in the reward), what the group estimators compare;
    mask: [B, T] valid response tokens; group: [B] int64 group id per row (its prompt);
    values: [B, T] the critic's values (GAE only), else None;
    population: (scores [N], group [N]) of the whole batch when these rows are one rank's
        share of it (their own among them): group statistics are taken over it. None: these
        rows are the whole batch.
    """
    rewards: Tensor
    scores: Tensor
    mask: Tensor
    group: Tensor
    values: Optional[Tensor] = None
    population: Optional[Tuple[Tensor, Tensor]] = None


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


def _group_sums(scores: Tensor, group: Tensor, population) -> Tuple[Tensor, Tensor, Tensor]:
    """(count, sum, sum of squares about the group mean), each [B]: the statistics of each
    row's group over ``population`` (scores [N], group [N]; these rows among them), or over
    the rows themselves when it is None."""
    pop_scores, pop_group = population if population is not None else (scores, group)
    check_shapes("group statistics", "population scores", pop_scores.shape, group=pop_group)
    _, index = torch.unique(torch.cat([pop_group, group]), return_inverse=True)
    pop, rows = index[:pop_group.numel()], index[pop_group.numel():]
    size = int(index.max()) + 1
    pop_scores = pop_scores.to(scores.dtype)
    count = torch.zeros(size, dtype=scores.dtype, device=scores.device).index_add(0, pop, torch.ones_like(pop_scores))
    total = torch.zeros_like(count).index_add(0, pop, pop_scores)
    mean = total / count.clamp(min=1)
    squares = torch.zeros_like(count).index_add(0, pop, (pop_scores - mean[pop]) ** 2)
    return count[rows], total[rows], squares[rows]


def group_baseline(scores: Tensor, group: Tensor, *, leave_one_out: bool, population=None) -> Tuple[Tensor, Tensor]:
    """(baseline [B], group size [B]): each row's group mean of ``scores`` [B], or with
    ``leave_one_out`` the mean of the OTHER rows of its group; 0 for a group of one.
    ``population``: the (scores [N], group [N]) the groups are taken over, these rows included."""
    check_shapes("group_baseline", "scores", scores.shape, group=group)
    n, s, _ = _group_sums(scores, group, population)
    if leave_one_out:
        baseline = torch.where(n > 1, (s - scores) / (n - 1).clamp(min=1), torch.zeros_like(scores))
    else:
        baseline = torch.where(n > 1, s / n, torch.zeros_like(scores))
    return baseline, n


def group_std(scores: Tensor, group: Tensor, population=None) -> Tensor:
    """[B] the unbiased standard deviation of each row's group (1 for a group of one)."""
    n, _, squares = _group_sums(scores, group, population)
    return torch.where(n > 1, (squares / (n - 1).clamp(min=1)).sqrt(), torch.ones_like(scores))


def _on_tokens(per_sequence: Tensor, mask: Tensor) -> Tensor:
    """[B] -> [B, T]: the sequence's value on each of its valid tokens, 0 on padding."""
    return zero_pad(per_sequence[:, None].expand(mask.shape).to(torch.float32), mask)


def returns_to_go(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """[B, T] the discounted sum of ``rewards`` [B, T] from each valid token to the row's end."""
    r = zero_pad(rewards.detach(), mask)
    running = torch.zeros_like(r[:, 0])
    out = [None] * r.shape[1]
    for t in reversed(range(r.shape[1])):
        running = r[:, t] + gamma * running
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


def grpo_advantages(x: AdvantageInputs, opt: EstimatorOptions, reduce=local_sums) -> Result:
    """(score - group mean) / (group std + eps) on every token; without ``scale_by_std``
    only the mean is taken off (Dr. GRPO). A group whose scores are equal gets 0."""
    _check("grpo", x)
    scores = x.scores.detach().to(torch.float32)
    mean, _ = group_baseline(scores, x.group, leave_one_out=False, population=x.population)
    adv = scores - mean
    if opt.scale_by_std:  # equal scores: nothing to learn, 0 (not 0 / 0)
        std = group_std(scores, x.group, x.population)
        adv = torch.where(std > 0, adv / (std + opt.eps), torch.zeros_like(adv))
    return _on_tokens(adv, x.mask), None


def rloo_advantages(x: AdvantageInputs, opt: EstimatorOptions, reduce=local_sums) -> Result:
    """score minus the mean score of the group's other samples, on every token."""
    _check("rloo", x)
    scores = x.scores.detach().to(torch.float32)
    baseline, _ = group_baseline(scores, x.group, leave_one_out=True, population=x.population)
    return _on_tokens(scores - baseline, x.mask), None


def reinforce_pp_advantages(x: AdvantageInputs, opt: EstimatorOptions, reduce=local_sums) -> Result:
    """REINFORCE++: the returns-to-go of the dense rewards (KL per token, score at the end),
    whitened over the whole batch (``reduce``: over every rank's rows)."""
    _check("reinforce_pp", x)
    return batch_whiten(returns_to_go(x.rewards, x.mask, opt.gamma), x.mask, reduce), None


def reinforce_pp_baseline_advantages(x: AdvantageInputs, opt: EstimatorOptions, reduce=local_sums) -> Result:
    """REINFORCE++ with a group baseline: the group's mean score is taken off the last
    token's reward first, then returns-to-go and batch whitening as reinforce_pp."""
    _check("reinforce_pp_baseline", x)
    mean, _ = group_baseline(x.scores.detach().to(x.rewards.dtype), x.group, leave_one_out=False,
                             population=x.population)
    last = last_token_index((x.mask != 0).long())
    rows = torch.arange(x.mask.shape[0], device=x.mask.device)
    rewards = x.rewards.detach().index_put((rows, last), -mean, accumulate=True)
    return batch_whiten(returns_to_go(rewards, x.mask, opt.gamma), x.mask, reduce), None


@dataclass(frozen=True)
class Estimator:
    fn: Callable[..., Result]
    needs_critic: bool
    uses_groups: bool


ESTIMATORS = {
    "gae": Estimator(gae_advantages, needs_critic=True, uses_groups=False),
    "grpo": Estimator(grpo_advantages, needs_critic=False, uses_groups=True),
    "rloo": Estimator(rloo_advantages, needs_critic=False, uses_groups=True),
    "reinforce_pp": Estimator(reinforce_pp_advantages, needs_critic=False, uses_groups=False),
    "reinforce_pp_baseline": Estimator(reinforce_pp_baseline_advantages, needs_critic=False, uses_groups=True),
}


def estimator(name: str) -> Estimator:
    """The estimator called ``name``; a one-line error listing the valid names otherwise."""
    require(name in ESTIMATORS, f"advantage estimator {name!r} is unknown; use one of {', '.join(ESTIMATORS)}")
    return ESTIMATORS[name]

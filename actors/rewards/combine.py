"""A composed reward's pair score from its sources' scores (reward.sources, reward.combine).

Pure numpy, no torch: the config imports the table's names. K = sources, N = pairs; ``groups``
[N] says which pairs are samples of one prompt (a GRPO group: equal ids, any integers).

    sum    score_i = sum_k w_k r_k,i
    gdpo   score_i = sum_k w_k (r_k,i - mean_g r_k) / (std_g r_k + EPS)

gdpo is GDPO's decoupled normalisation (Liu et al., "GDPO: Group reward-Decoupled Normalization
Policy Optimization for Multi-reward RL Optimization", 2026): each source's scores are normalised
within the pair's group g before the weighted sum, so that a source with a wide spread cannot
drown one with a narrow spread, and two different mixes of the sources' scores do not collapse to
one advantage. mean and std are over the group's valid pairs, std with Bessel's correction (n - 1)
and EPS = 1e-4, as the authors' TRL implementation computes them; a group with one valid pair, or
whose source scores are all equal, gets 0 from that source. The paper then whitens the summed
advantages over the batch: the learner's ``ppo.advantage: reinforce_pp_baseline`` does that step
(its group-mean baseline is already 0 here); ``grpo`` instead divides by each group's std again.

A pair is valid when every source scored it (a monitor too, weight 0): one invalid source makes
the pair invalid, as an invalid single score does. A monitor never enters the sum.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

EPS = 1e-4  # the std's guard in gdpo's denominator


def group_normalised(values: np.ndarray, valid: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """[N] float64: (values - group mean) / (group std + EPS) over each group's valid pairs;
    NaN at invalid pairs. ``values`` [N] float, ``valid`` [N] bool, ``groups`` [N] int."""
    values, valid = np.asarray(values, dtype=np.float64), np.asarray(valid, dtype=bool)
    out = np.full(values.shape, np.nan)
    for g in np.unique(groups):
        members = np.flatnonzero((groups == g) & valid)
        if members.size == 0:
            continue
        x = values[members]
        if members.size == 1 or np.all(x == x[0]):  # no spread: nothing to prefer in this group
            out[members] = 0.0
            continue
        out[members] = (x - x.mean()) / (x.std(ddof=1) + EPS)
    return out


def sum_scores(components: np.ndarray, valid: np.ndarray, weights: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """[N] float64: sum_k w_k r_k,i of ``components`` [K, N] (``valid`` [K, N] bool, ``weights`` [K]);
    a weight-0 source adds nothing, even where its score is large."""
    out = np.zeros(components.shape[1])
    for c, w in zip(np.asarray(components, dtype=np.float64), weights):
        if w != 0:
            out += w * c
    return out


def gdpo_scores(components: np.ndarray, valid: np.ndarray, weights: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """[N] float64: sum_k w_k (r_k - group mean) / (group std + EPS), the groups' statistics over
    the pairs every source scored (``valid`` [K, N]: a pair out of training is out of them too)."""
    pair_valid = np.asarray(valid, dtype=bool).all(axis=0)
    out = np.zeros(components.shape[1])
    for c, w in zip(np.asarray(components, dtype=np.float64), weights):
        if w != 0:
            out += w * np.nan_to_num(group_normalised(c, pair_valid, groups))
    return out


# reward.combine's choices: name -> (components [K, N], valid [K, N], weights [K], groups [N]) -> [N].
COMBINERS: dict[str, Callable] = {"sum": sum_scores, "gdpo": gdpo_scores}


def combine(components: np.ndarray, valid: np.ndarray, weights, groups, how: str) -> tuple[np.ndarray, np.ndarray]:
    """(scores [N] float32, NaN where invalid; valid [N] bool): the pairs' scores under ``how``
    (a COMBINERS name). A pair is valid when every one of its K components is finite and valid."""
    components = np.asarray(components, dtype=np.float64)
    valid = np.asarray(valid, dtype=bool) & np.isfinite(components)
    if components.ndim != 2 or valid.shape != components.shape:
        raise ValueError(f"combine: components {components.shape} and valid {valid.shape} must both be [K, N]")
    weights, groups = np.asarray(weights, dtype=np.float64), np.asarray(groups).reshape(-1)
    if weights.shape != (components.shape[0],) or groups.shape != (components.shape[1],):
        raise ValueError(f"combine: weights {weights.shape} must be [K] and groups {groups.shape} [N] for "
                         f"components {components.shape}")
    if how not in COMBINERS:
        raise ValueError(f"combine: unknown {how!r}; use one of {', '.join(COMBINERS)}")
    pair_valid = valid.all(axis=0)
    with np.errstate(invalid="ignore", over="ignore"):
        scores = COMBINERS[how](np.where(valid, components, 0.0), valid, weights, groups)
        scores = scores.astype(np.float32)
    pair_valid &= np.isfinite(scores)
    return np.where(pair_valid, scores, np.nan).astype(np.float32), pair_valid

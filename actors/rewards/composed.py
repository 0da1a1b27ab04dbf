"""A reward replica's scores of a composed reward (reward.sources): its parts' results, scored
concurrently, combined into one per pair (actors/rewards/combine.py).

A replica holds one scorer per part (actors/reward.py builds each as a replica of that source
alone, in the same process: a judge part its engine, a reward-model part its weights) and calls
them at once, in threads: a pair's scoring takes its slowest part's time, not the sum. Each part
keeps its own time limit (its timeout_s, sandbox or http settings). The combined result keeps
each part's raw scores (``ScoreResult.components``: the step metrics reward/<name>/mean and the
samples' "components"), and its errors prefixed with the part's name.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np

from actors.rewards.combine import combine
from actors.rewards.scoring import ScoreResult


def score_parts(calls: Sequence[Callable[[], ScoreResult]], pool: ThreadPoolExecutor | None) -> list[ScoreResult]:
    """Each call's result, the calls run concurrently in ``pool`` (None: one after another)."""
    if pool is None or len(calls) < 2:
        return [call() for call in calls]
    return [f.result() for f in [pool.submit(call) for call in calls]]


def compose(parts: Sequence, results: Sequence[ScoreResult], groups, how: str) -> ScoreResult:
    """One ScoreResult of N pairs from each part's (``parts``: RewardParts, ``results`` theirs in
    order, ``groups`` [N] the pairs' prompt groups, ``how`` a reward.combine name)."""
    components = np.stack([np.asarray(r.scores, dtype=np.float32) for r in results])
    valid = np.stack([np.asarray(r.valid, dtype=bool) for r in results])
    scores, pair_valid = combine(components, valid, [p.weight for p in parts], groups, how)
    counts: dict = {}
    for r in results:
        for k, v in r.counts.items():
            counts[k] = counts.get(k, 0) + v
    errors = [f"source {p.name}: {e}" for p, r in zip(parts, results) for e in r.errors]
    return ScoreResult(scores, pair_valid, errors, failed=any(r.failed for r in results), counts=counts,
                       components={p.name: np.where(v, c, np.nan).astype(np.float32)
                                   for p, c, v in zip(parts, components, valid)})


def same_prompt_groups(prompts: Sequence[np.ndarray]) -> np.ndarray:
    """[N] int64 group ids: pairs whose prompt tokens are equal share one (for a caller that has
    no prompt indices)."""
    ids: dict = {}
    return np.array([ids.setdefault(np.asarray(p).tobytes(), len(ids)) for p in prompts], dtype=np.int64)


def attach_components(scored: list, rollouts: list, result: ScoreResult) -> None:
    """Set each ScoredRollout's ``components`` (its sources' scores) from ``result`` (the chunk's
    ScoreResult, in ``rollouts``' order); ``scored`` is core.annotate.annotate_valid's output: the
    valid rollouts with trained tokens, in order. Nothing for a reward of one source."""
    if not result.components:
        return
    kept = [i for i in np.flatnonzero(result.valid) if rollouts[i].trained_tokens > 0]
    if len(kept) != len(scored):
        raise ValueError(f"attach_components: {len(scored)} scored rollouts for {len(kept)} valid ones with tokens")
    for x, i in zip(scored, kept):
        x.components = {name: float(values[i]) for name, values in result.components.items()}

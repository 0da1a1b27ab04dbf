"""What the run shows of its policy besides the training metrics: the held-out evaluation
(mean score, gold score and response length on the eval prompts, with the current weights),
the sample rollouts written to samples.jsonl, decoded (with their prompt rows' other fields),
and the step's reward per data source."""
from __future__ import annotations

import logging

import ray
from ray.exceptions import ObjectLostError, RayActorError

log = logging.getLogger("tether")


def evaluate(eval_dataset, pools, *, gold: bool) -> dict:
    """eval/* metrics of ``eval_dataset``'s prompts, sampled by the first generator and scored by
    the first reward (and its gold score when ``gold``); {} without eval prompts."""
    if eval_dataset is None or len(eval_dataset) == 0:
        return {}
    generator, reward = pools.generators.first(), pools.rewards.first()
    try:
        rollouts_ref, summary_ref = generator.sample.options(num_returns=2).remote(
            eval_dataset.prompt_ids, list(eval_dataset.ids))
        summary = ray.get(summary_ref)
        if not summary.rollouts:
            return {}
        scores_ref = reward.score_rollouts.remote(rollouts_ref)
        gold_ref = reward.gold_scores.remote(rollouts_ref) if gold else None
        scores = ray.get(scores_ref)
        gold_scores = ray.get(gold_ref) if gold_ref is not None else None
    except (RayActorError, ObjectLostError) as e:  # a replica or its node died: replaced by the producer
        log.warning("eval skipped: a replica died (%s)", type(e).__name__)
        return {}
    out = {"eval/score_mean": _valid_mean(scores), "eval/response_len": summary.generated_tokens / summary.rollouts}
    if gold_scores is not None:
        out["eval/gold_score"] = _valid_mean(gold_scores)
    return out


def _valid_mean(result) -> float:
    """Mean of a ScoreResult's valid scores (NaN when none is valid)."""
    valid = result.scores[result.valid]
    return float(valid.mean()) if len(valid) else float("nan")

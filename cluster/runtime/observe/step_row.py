"""One PPO step's row of metrics.jsonl, from what the step did (the keys' meanings: metric_set.py),
and the step's sample rows as samples.jsonl holds them."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cluster.runtime.observe.produced import Produced, episode_metrics, transfer_metrics
from core.infra.transfer import Transfer
from learner.worker import TO_LEARNER


@dataclass(frozen=True)
class StepFacts:
    """The driver's side of a step: the policy and data position after it, and its timings."""
    kl_beta: float
    version: int
    batches_issued: int
    pool_sizes: dict          # role -> live replicas
    seconds: dict             # phase -> wall-clock seconds (PhaseTimer)
    admission_wait_s: float   # async mode: the producer's wait at the admission gate


@dataclass(frozen=True)
class StepRow:
    """Builds a step's row; the run's settings the row depends on are fixed here."""
    filter_groups: bool       # ppo.filter_groups: dynamic sampling's metrics are in the row
    columns: object           # the dataset's PromptColumns (core/columns.py): per-source metrics
    source_field: str         # data.source_field

    def build(self, batch, produced: Produced, learn: dict, sync: dict, facts: StepFacts) -> dict:
        """``batch``: the buffer's summary of what was trained on; ``learn``: the learner's metrics
        (its transfer/* taken out here); ``sync``: the weight push's report."""
        moved = transfer_metrics(produced, Transfer.pop_metrics(learn, TO_LEARNER))  # learn keeps the rest
        seconds = facts.seconds
        return {"reward/mean": batch.scores.mean(), "reward/std": batch.scores.std(),
                "kl/mean": batch.kl_sums.mean(), "kl/beta": facts.kl_beta,
                "response/length_mean": batch.response_lengths.mean(),
                "response/truncated_frac": float(batch.truncated.mean()),
                "rollouts/used": len(batch.scores), "rollouts/prompts": produced.prompts,
                "rollouts/skipped_prompts": produced.skipped_prompts,
                "rollouts/invalid_scores": produced.invalid_scores,
                "reward/timeouts": produced.reward_counts.get("timeouts", 0),
                "reward/crashes": produced.reward_counts.get("crashes", 0),
                "rollouts/empty_responses": produced.empty_responses,
                "rollouts/incomplete_kept_sets": produced.incomplete_kept_sets,
                "rollouts/duplicate_chunks": produced.duplicate_chunks,
                "rollouts/redispatched_chunks": produced.redispatched_chunks,
                **self._filter_metrics(produced, batch), **episode_metrics(produced.episode_counts),
                "policy/version": facts.version, "data/batches_issued": facts.batches_issued,
                **{f"pool/{role}_replicas": n for role, n in facts.pool_sizes.items()},
                "buffer/depth": batch.buffer_depth,
                "buffer/dropped_stale": batch.dropped_stale,
                "buffer/staleness_mean": float(batch.staleness.mean()),
                "buffer/staleness_max": int(batch.staleness.max()),
                "buffer/token_staleness_mean": float(batch.token_staleness.mean()),
                "rollouts/partial_frac": float(batch.partial.mean()),
                "perf/step_seconds": seconds["step"], "perf/generate_seconds": produced.generate_seconds,
                "perf/score_seconds": produced.score_seconds,
                "perf/buffer_wait_seconds": seconds["buffer_wait"], "perf/learn_seconds": seconds["learn"],
                "perf/admission_wait_seconds": facts.admission_wait_s,
                "perf/sync_seconds": sync.get("seconds", seconds["sync"]), "perf/sync_bytes": sync.get("bytes", 0),
                "perf/sync_wait_seconds": sync.get("wait_seconds", 0.0),
                "perf/tokens_per_s": produced.tokens / max(produced.generate_seconds, 1e-9), **moved, **learn,
                **source_metrics(batch, self.columns, self.source_field), **component_metrics(batch),
                **{f"reward/{k}": v for k, v in produced.reward_counts.items()}}

    def _filter_metrics(self, produced: Produced, batch) -> dict:
        """Dynamic sampling's share left out and what refilling the step cost (ppo.filter_groups)."""
        if not self.filter_groups:
            return {}
        sampled = max(produced.prompts - produced.skipped_prompts, 1)
        return {"rollouts/filtered_frac": produced.filtered_prompts / sampled,
                "rollouts/extra_generated": produced.extra_rollouts, "rollouts/surplus": batch.surplus}


def decode_sample(tokenizer, row: dict, columns=None) -> dict:
    """One of a batch's sample rows as samples.jsonl holds it: prompt and response as text, and
    under "columns" its prompt row's other fields (``columns``: core.columns.PromptColumns). An
    episode's row also has its "transcript": the response's turns in order, each {"by": "policy"
    (trained) or "environment" (an observation, not trained), "tokens": n, "version": the policy
    version that sampled it (an observation: the turn's before it), "text": ...}; a turn a
    weight push landed in is two parts."""
    dec = tokenizer.decode
    out = {"prompt": dec(row["prompt_ids"], skip_special_tokens=True),
           "response": dec(row["response_ids"], skip_special_tokens=True),
           **{k: row[k] for k in ("score", "kl_sum", "finish_reason", "policy_version")},
           **({"components": row["components"]} if "components" in row else {})}
    if "spans" in row:
        out["transcript"] = [{"by": "policy" if trained else "environment", "tokens": end - start,
                              "version": version,
                              "text": dec(row["response_ids"][start:end], skip_special_tokens=False)}
                             for start, end, trained, version in row["spans"]]
    if columns is not None and columns.names and "prompt_index" in row:
        out["columns"] = columns.row(row["prompt_index"])
    return out


def source_metrics(batch, columns, source_field: str) -> dict:
    """reward/<source>/mean and reward/<source>/count of a BatchSummary: its rollouts grouped by
    the ``source_field`` of their prompt rows (data.source_field); {} when the data has none.
    Rows without a source are left out of every group."""
    if columns is None or source_field not in columns.names or batch.prompt_indices is None:
        return {}
    sources = [columns.row(i).get(source_field) for i in batch.prompt_indices.tolist()]
    out = {}
    for name in sorted({str(s) for s in sources if s is not None}):
        mine = np.array([s is not None and str(s) == name for s in sources])
        out[f"reward/{name}/mean"] = float(batch.scores[mine].mean())
        out[f"reward/{name}/count"] = int(mine.sum())
    return out


def component_metrics(batch) -> dict:
    """reward/<name>/mean of a BatchSummary: each reward.sources source's mean score over the
    rollouts trained on (a monitor's too); {} for a reward of one source."""
    return {f"reward/{name}/mean": float(values.mean()) for name, values in (batch.components or {}).items()}

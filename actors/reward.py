"""Reward: one score per (prompt, response), from a frozen reward model or a function.

A bad score must never take the run down: the actor reports it per item
(``ScoreResult.valid``) with a one-line message, counts it, and keeps serving.
Invalid items carry NaN in ``scores`` so that a caller that forgets to filter
them fails loudly (``annotate`` rejects non-finite scores) instead of training on 0.
"""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from actors.rewards.composed import compose, same_prompt_groups, score_parts
from actors.rewards.config import RewardConfig
from actors.rewards.environment_scores import environment_scores, void_invalid_episodes
from actors.rewards.group_judge import GroupJudgeScorer
from actors.rewards.http import HTTPScorer
from actors.rewards.reward_model import RewardModelScorer
from actors.rewards.scoring import (
    Columns,
    ScoreResult,
    TextScorer,
)
from actors.rewards.source import RewardSource, configured_source, gold_source
from core.columns import PromptColumns
from core.infra.threads import fit_threads
from core.infra.transfer import Pull, Transfer, pull_args
from core.modeling.loading import (
    as_token_arrays,
    load_tokenizer,
)

log = logging.getLogger(__name__)

def resolve_tokenizer_path(path: str) -> str:
    """A tokenizer directory has no config.json necessarily; only insist that it exists."""
    p = Path(str(path)).expanduser()
    if p.is_absolute() or str(path).startswith((".", "~")) or p.exists():
        if not p.is_dir():
            raise FileNotFoundError(f"Reward: tokenizer path {str(p)!r} does not exist")
        return str(p)
    return str(path)


class Reward:
    """Scores token batches with the source ``source`` of ``config`` (a RewardConfig, the
    ``reward`` section; actors/rewards/source.py's table): a reward model (a sequence classifier
    with num_labels=1), a function (``"module:function"`` called as
    ``fn(prompts: list[str], responses: list[str], **columns) -> list[float]``), a reward server,
    a judge model's vLLM engine (reward.judge, its model resolved), or the episodes' own scores.

    Text sources need ``tokenizer`` (a path) to decode tokens and hand the pairs to a text scorer
    (actors/rewards/scoring.py); a reward model reads the prompt+response token ids themselves
    (actors/rewards/reward_model.py), so it must share the policy's vocabulary. A function is
    called once per ``score`` call.
    ``config.gold`` (a function spec, needs ``tokenizer``) is the evaluation-only score of
    ``gold_scores``: what the proxy reward stands in for. A function (or gold) call that does not
    return within ``config.timeout_s`` leaves its items invalid and goes on in an abandoned
    thread (actors/rewards/timed_call.py); the replica serves the next call. ``columns``: the
    prompt rows' other fields by dataset id (core/columns.py; the driver puts the table in the
    object store once and every replica gets that reference): ``score_rollouts`` and
    ``gold_scores`` look each rollout's up by its ``prompt_index`` and pass them to the text
    scorer; a reward model ignores them. With ``config.sandbox.workers`` > 0 the function and gold
    score one pair at a time in worker processes (actors/rewards/sandbox.py): a pair that hangs,
    crashes or runs out of memory is invalid, and its worker replaced. ``dtype``: the reward
    model's and the judge engine's (where reward.judge.engine.dtype is null); ``seed``: the judge's.
    With reward.sources the replica holds one replica of each source alone (``parts``), scores
    them concurrently and combines their scores by reward.combine (actors/rewards/composed.py).
    """

    def __init__(self, *, config: RewardConfig, source: RewardSource | None = None, tokenizer: str | None = None,
                 dtype: str = "float32", seed: int = 0, columns: PromptColumns | None = None,
                 device: str | None = None):
        fit_threads()
        source = source or configured_source(config)
        if config.batch_size < 1:
            raise ValueError(f"Reward: batch_size must be >= 1, got {config.batch_size}")
        self.source = source
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.text_tokenizer = None
        self.columns = columns if columns is not None else PromptColumns()
        self.scorer: TextScorer | None = source.text_scorer(config, dtype=dtype, seed=seed)
        self.gold: TextScorer | None = None if config.gold is None else gold_source(config).text_scorer(
            config, key="reward.gold")
        if self.scorer is not None or self.gold is not None:  # text rewards see decoded tokens
            if tokenizer is None:
                raise ValueError(f"Reward: {(self.scorer or self.gold).name} needs tokenizer= (a path) to decode "
                                 "tokens")
            self.text_tokenizer = load_tokenizer(resolve_tokenizer_path(tokenizer), "Reward")
        self.reward_model: RewardModelScorer | None = source.token_scorer(config, dtype=dtype, device=self.device)
        self.parts = tuple((part, Reward(config=part.config, source=part.source, tokenizer=tokenizer, dtype=dtype,
                                         seed=seed, columns=self.columns, device=device)) for part in source.parts)
        self.combine = config.combine
        self._pool = ThreadPoolExecutor(len(self.parts), "reward-part") if len(self.parts) > 1 else None
        self._counts = {"calls": 0, "items": 0, "invalid_items": 0, "failed_calls": 0, "timeouts": 0, "crashes": 0,
                        "seconds": 0.0}
        self.last_error: str | None = None

    def score(self, prompt_ids_batch: list[np.ndarray], response_ids_batch: list[np.ndarray],
              columns: Columns | None = None, groups=None) -> ScoreResult:
        """One score per (prompt, response) token pair; ``columns``: the prompt rows' other
        fields, each a list as long as the batch (a text reward gets them as keyword arguments);
        ``groups`` [N]: which pairs are samples of one prompt (a group judge's and gdpo's groups;
        None: the pairs of equal prompt tokens)."""
        prompts, responses = as_token_arrays(prompt_ids_batch, response_ids_batch, "Reward.score")
        start = time.perf_counter()
        n = len(prompts)
        groups = same_prompt_groups(prompts) if groups is None else np.asarray(groups)
        if n == 0:
            result = ScoreResult(np.zeros(0, np.float32), np.zeros(0, bool))
        elif self.parts:
            result = self._composed([lambda sub=sub: sub.score(prompts, responses, columns, groups)
                                     for _, sub in self.parts], groups)
        elif self.scorer is not None:
            result = self._score_text(self.scorer, prompts, responses, columns or {}, groups)
        elif self.reward_model is None:
            raise ValueError(f"Reward.score: {self.source.name} scores the episodes themselves; call score_rollouts")
        else:
            result = self.reward_model.score_tokens(prompts, responses)
        return self._counted(result, n, start)

    def _composed(self, calls: list, groups) -> ScoreResult:
        """reward.sources: each part's call (its result), run concurrently, combined by reward.combine."""
        return compose([part for part, _ in self.parts], score_parts(calls, self._pool), groups, self.combine)

    def _counted(self, result: ScoreResult, n: int, start: float) -> ScoreResult:
        """``result`` (of ``n`` pairs, scoring since perf_counter() ``start``) counted in stats()."""
        self._counts["calls"] += 1
        self._counts["items"] += n
        self._counts["invalid_items"] += result.n_invalid
        self._counts["failed_calls"] += int(result.failed)
        self._counts["seconds"] += time.perf_counter() - start
        for k, v in result.counts.items():
            self._counts[k] = self._counts.get(k, 0) + v
        if result.errors:
            self.last_error = result.errors[-1]
            for msg in result.errors:
                log.warning("%s", msg)
        return result

    def score_rollouts(self, rollouts: list) -> ScoreResult:
        """score() of Rollouts, for a caller that passes the generator's output by reference;
        their columns are looked up by prompt_index (none when one is not a dataset id). With
        with the environment as the source: the episodes' own scores (actors/rewards/environment_scores.py)."""
        if self.parts:  # each part scores the rollouts its way (an environment part: the episodes' own)
            start, groups = time.perf_counter(), np.array([r.prompt_index for r in rollouts], dtype=np.int64)
            result = self._composed([lambda sub=sub: sub.score_rollouts(rollouts) for _, sub in self.parts], groups)
            return void_invalid_episodes(self._counted(result, len(rollouts), start), rollouts)
        if self.source.from_episodes:
            result = environment_scores(rollouts)
            for key, n in (("calls", 1), ("items", len(rollouts)), ("invalid_items", result.n_invalid)):
                self._counts[key] += n
            for msg in result.errors:
                log.warning("%s", msg)
            return result
        result = self.score([r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts],
                            self.rollout_columns(rollouts), [r.prompt_index for r in rollouts])
        return void_invalid_episodes(result, rollouts)

    def rollout_columns(self, rollouts: list) -> Columns:
        """The rollouts' prompt rows' other fields, one value per rollout ({} without a table,
        or when a prompt_index is not in it)."""
        if self.scorer is None and self.gold is None:  # a reward model reads tokens only
            return {}
        return self.columns.take([r.prompt_index for r in rollouts])

    def score_rollouts_pulled(self, rollouts: Pull) -> tuple[ScoreResult, Transfer]:
        """score_rollouts() of Rollouts this call pulls itself (call it with num_returns=2): the
        scores, and what the pull moved between nodes (core/infra/transfer.py)."""
        (rollouts,), moved = pull_args(rollouts)
        return self.score_rollouts(rollouts), moved

    def gold_scores(self, rollouts: list) -> ScoreResult:
        """The ``gold`` function's scores of Rollouts (evaluation only; not counted in stats())."""
        if self.gold is None:
            raise ValueError("Reward.gold_scores: this replica has no gold function; set reward.gold")
        prompts, responses = as_token_arrays([r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts],
                                             "Reward.gold_scores")
        return self._score_text(self.gold, prompts, responses, self.rollout_columns(rollouts))

    def _score_text(self, scorer: TextScorer, prompts, responses, columns: Columns, groups=None) -> ScoreResult:
        """A text scorer's scores of token arrays (decoded here); its failures are per-item results."""
        if isinstance(scorer, HTTPScorer):  # a server gets the text OpenRLHF would send, special tokens and all
            return scorer.score_ids(self.text_tokenizer, prompts, responses, columns)
        decode = lambda seqs: self.text_tokenizer.batch_decode([s.tolist() for s in seqs], skip_special_tokens=True)
        if isinstance(scorer, GroupJudgeScorer):  # one judge call per prompt group
            return scorer.score_texts(decode(prompts), decode(responses), columns, groups)
        return scorer.score_texts(decode(prompts), decode(responses), columns)

    def stats(self) -> dict:
        abandoned = sum(s.stats().get("abandoned_calls", 0) for s in (self.scorer, self.gold) if s is not None) + \
            sum(sub.stats()["abandoned_calls"] for _, sub in self.parts)
        return {**{k: (round(v, 3) if isinstance(v, float) else v) for k, v in self._counts.items()},
                "abandoned_calls": abandoned, "last_error": self.last_error}

    def close(self) -> None:
        """Stop the text scorers' workers (a sandbox's processes); the replica scores no more."""
        for scorer in (self.scorer, self.gold):
            if scorer is not None:
                scorer.close()
        for _, sub in self.parts:
            sub.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def health(self) -> dict:
        if self.parts:  # each source's own health, by its name; the replica's dtype is its first model's
            sources = {part.name: sub.health() for part, sub in self.parts}
            dtypes = [h["dtype"] for h in sources.values() if "dtype" in h]
            source = {"scorer": "sources", "sources": sources, **({"dtype": dtypes[0]} if dtypes else {})}
        elif self.reward_model is not None:
            source = self.reward_model.health()
        elif self.scorer is not None:  # the scorer's own counters (a judge's include its engine's dtype)
            source = {self.source.type.name: self.source.spec, "scorer": self.scorer.name, **self.scorer.stats()}
        else:  # the episodes carry their scores
            source = {"scorer": "environment", self.source.type.name: self.source.spec}
        return {"role": "reward", "ok": True, "pid": os.getpid(), **source, "device": str(self.device),
                "columns": list(self.columns.names), **self.stats()}

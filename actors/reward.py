"""Reward: one score per (prompt, response), from a frozen reward model or a function.

A bad score must never take the run down: the actor reports it per item
(``ScoreResult.valid``) with a one-line message, counts it, and keeps serving.
Invalid items carry NaN in ``scores`` so that a caller that forgets to filter
them fails loudly (``annotate`` rejects non-finite scores) instead of training on 0.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch

from actors.rewards.config import RewardConfig
from actors.rewards.environment_scores import environment_scores, void_invalid_episodes
from actors.rewards.http import HTTPScorer
from actors.rewards.scoring import (
    Columns,
    ScoreResult,
    TextScorer,
    finalise,
)
from actors.rewards.source import RewardSource, configured_source, gold_source
from core.columns import PromptColumns
from core.infra.dtypes import torch_dtype
from core.infra.errors import type_and_first_line
from core.infra.threads import fit_threads
from core.infra.transfer import Pull, Transfer, pull_args
from core.layout import pad_right, pool_last_token
from core.modeling.architectures import load_pretrained
from core.modeling.loading import (
    as_token_arrays,
    length_sorted_chunks,
    load_tokenizer,
    pad_token_id,
    resolve_model_path,
)
from core.modeling.packed_rows import pack_sequences
from core.modeling.varlen_attention import use_varlen

log = logging.getLogger(__name__)

# Written by the reward-model stage (cluster/recipes/reward_model.py) beside its checkpoint: the mean
# and std of the model's scores over its training responses, for reward.normalize.
REWARD_STATS_FILE = "reward_stats.json"


def load_reward_stats(model_dir: str) -> tuple[float, float]:
    """(mean, std) from ``model_dir/reward_stats.json``; a one-line ValueError if absent or unusable."""
    path = Path(model_dir) / REWARD_STATS_FILE
    try:
        stats = json.loads(path.read_text())
        mean, std = float(stats["mean"]), float(stats["std"])
    except FileNotFoundError:
        raise ValueError(f"reward.normalize is true but {path} does not exist; train the reward model with "
                         "python -m cluster.reward_model (it writes the file), or set reward.normalize=false") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"reward.normalize: {path} is unusable ({type_and_first_line(e)}); it needs numbers "
                         "'mean' and 'std'") from None
    if not (np.isfinite(mean) and np.isfinite(std) and std > 0):
        raise ValueError(f"reward.normalize: {path} has mean={mean}, std={std}; std must be a finite number > 0")
    return mean, std


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
    (actors/rewards/scoring.py); the model path feeds prompt+response token ids straight to the
    model, so the reward model must share the policy's vocabulary. ``config.batch_size`` bounds a
    model forward, which runs its sequences as one packed row (core/modeling/packed_rows.py) with
    ``config.packing``, else right-padded; a function is called once per ``score`` call.
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
    """

    def __init__(self, *, config: RewardConfig, source: RewardSource | None = None, tokenizer: str | None = None,
                 dtype: str = "float32", seed: int = 0, columns: PromptColumns | None = None,
                 device: str | None = None):
        fit_threads()
        source = source or configured_source(config)
        if config.batch_size < 1:
            raise ValueError(f"Reward: batch_size must be >= 1, got {config.batch_size}")
        self.source = source
        self.batch_size, self.packing = int(config.batch_size), bool(config.packing)
        self.model_path = None
        self.model = self.text_tokenizer = None
        self.normalization: tuple[float, float] | None = None  # (mean, std) applied to model scores
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.timeout_s = float(config.timeout_s)
        self.columns = columns if columns is not None else PromptColumns()
        self.scorer: TextScorer | None = source.text_scorer(config, dtype=dtype, seed=seed)
        self.gold: TextScorer | None = None if config.gold is None else gold_source(config).text_scorer(
            config, key="reward.gold")
        if self.scorer is not None or self.gold is not None:  # text rewards see decoded tokens
            if tokenizer is None:
                raise ValueError(f"Reward: {(self.scorer or self.gold).name} needs tokenizer= (a path) to decode "
                                 "tokens")
            self.text_tokenizer = load_tokenizer(resolve_tokenizer_path(tokenizer), "Reward")
        if source.holds_model and self.scorer is None:  # a reward model: its forward runs here
            self._load_model(source.spec, torch_dtype(dtype, "Reward"))
            if config.normalize:
                self.normalization = load_reward_stats(self.model_path)
        self._counts = {"calls": 0, "items": 0, "invalid_items": 0, "failed_calls": 0, "timeouts": 0, "crashes": 0,
                        "seconds": 0.0}
        self.last_error: str | None = None

    def _load_model(self, model: str, dtype: torch.dtype) -> None:
        from transformers import AutoModelForSequenceClassification

        self.model_path = resolve_model_path(model, "Reward")
        try:
            m = load_pretrained(AutoModelForSequenceClassification, self.model_path, dtype=dtype)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"Reward: cannot load a sequence classifier from {self.model_path!r}: "
                             f"{type_and_first_line(e)}") from None
        if m.config.num_labels != 1:
            raise ValueError(f"Reward: {self.model_path!r} has num_labels={m.config.num_labels}; "
                             "a reward model needs exactly 1")
        # HF pools at the last token whose id != pad_token_id, which is wrong when pad == eos
        # and the response ends in eos; we run the body and apply the head at our own index.
        head = getattr(m, "score", None)
        if not isinstance(head, torch.nn.Module):
            raise ValueError(f"Reward: {type(m).__name__} at {self.model_path!r} has no `score` head; "
                             "only decoder-style sequence classifiers (last-token pooling) are supported")
        self.model = m.to(self.device).eval()
        self.model.requires_grad_(False)
        self._head = head
        if self.packing:  # a packed row attends per sequence where the family allows (else its mask keeps them apart)
            use_varlen(self.model)
        self._forward = self._forward_packed if self.packing else self._forward_padded
        try:
            tokenizer = load_tokenizer(self.model_path, "Reward")
        except ValueError:
            tokenizer = None
        self.pad_id = pad_token_id(tokenizer, m.config, "Reward")

    def score(self, prompt_ids_batch: list[np.ndarray], response_ids_batch: list[np.ndarray],
              columns: Columns | None = None) -> ScoreResult:
        """One score per (prompt, response) token pair; ``columns``: the prompt rows' other
        fields, each a list as long as the batch (a text reward gets them as keyword arguments)."""
        prompts, responses = as_token_arrays(prompt_ids_batch, response_ids_batch, "Reward.score")
        start = time.perf_counter()
        n = len(prompts)
        if n == 0:
            result = ScoreResult(np.zeros(0, np.float32), np.zeros(0, bool))
        elif self.scorer is not None:
            result = self._score_text(self.scorer, prompts, responses, columns or {})
        elif self.model is None:
            raise ValueError(f"Reward.score: {self.source.name} scores the episodes themselves; call score_rollouts")
        else:
            result = self._score_model(prompts, responses)
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
        if self.source.from_episodes:
            result = environment_scores(rollouts)
            for key, n in (("calls", 1), ("items", len(rollouts)), ("invalid_items", result.n_invalid)):
                self._counts[key] += n
            for msg in result.errors:
                log.warning("%s", msg)
            return result
        result = self.score([r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts],
                            self.rollout_columns(rollouts))
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

    def _score_text(self, scorer: TextScorer, prompts, responses, columns: Columns) -> ScoreResult:
        """A text scorer's scores of token arrays (decoded here); its failures are per-item results."""
        if isinstance(scorer, HTTPScorer):  # a server gets the text OpenRLHF would send, special tokens and all
            return scorer.score_ids(self.text_tokenizer, prompts, responses, columns)
        decode = lambda seqs: self.text_tokenizer.batch_decode([s.tolist() for s in seqs], skip_special_tokens=True)
        return scorer.score_texts(decode(prompts), decode(responses), columns)

    def _score_model(self, prompts, responses) -> ScoreResult:
        seqs = [np.concatenate([p, r]) for p, r in zip(prompts, responses)]
        for i, s in enumerate(seqs):
            if s.size == 0:
                raise ValueError(f"Reward.score: item {i} has no tokens (empty prompt and response)")
        raw = np.empty(len(seqs), dtype=np.float32)
        for rows in length_sorted_chunks([s.size for s in seqs], self.batch_size):
            raw[rows] = self._forward([seqs[i] for i in rows])
        if self.normalization is not None:  # the training responses' scores become mean 0, std 1
            mean, std = self.normalization
            raw = (raw - mean) / std
        return finalise(raw, f"reward model {self.model_path}")

    @torch.inference_mode()
    def _forward_packed(self, seqs: list[np.ndarray]) -> np.ndarray:
        """The sequences as one packed row; the head at each sequence's last token."""
        row = pack_sequences(seqs, self.device)
        hidden = self.model.base_model(**row.inputs(self.model), use_cache=False).last_hidden_state  # [1, T, H]
        last = torch.from_numpy(row.ends - 1).to(self.device)
        return self._head(hidden[0, last]).float().squeeze(-1).cpu().numpy()

    @torch.inference_mode()
    def _forward_padded(self, seqs: list[np.ndarray]) -> np.ndarray:
        ids, mask = pad_right(seqs, self.pad_id)
        ids_t = torch.from_numpy(ids).to(self.device)
        mask_t = torch.from_numpy(mask).to(self.device)
        hidden = self.model.base_model(input_ids=ids_t, attention_mask=mask_t, use_cache=False).last_hidden_state
        return self._head(pool_last_token(hidden, mask_t)).float().squeeze(-1).cpu().numpy()

    def stats(self) -> dict:
        abandoned = sum(s.stats().get("abandoned_calls", 0) for s in (self.scorer, self.gold) if s is not None)
        return {**{k: (round(v, 3) if isinstance(v, float) else v) for k, v in self._counts.items()},
                "abandoned_calls": abandoned, "last_error": self.last_error}

    def close(self) -> None:
        """Stop the text scorers' workers (a sandbox's processes); the replica scores no more."""
        for scorer in (self.scorer, self.gold):
            if scorer is not None:
                scorer.close()

    def health(self) -> dict:
        if self.model is not None:
            dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
            source = {"model": self.model_path, "dtype": dtype, "packing": self.packing}
        elif self.scorer is not None:  # the scorer's own counters (a judge's include its engine's dtype)
            source = {self.source.type.name: self.source.spec, "scorer": self.scorer.name, **self.scorer.stats()}
        else:  # the episodes carry their scores
            source = {"scorer": "environment", self.source.type.name: self.source.spec}
        return {"role": "reward", "ok": True, "pid": os.getpid(), **source, "device": str(self.device),
                "columns": list(self.columns.names), **self.stats()}

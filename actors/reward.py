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

from actors.rewards.environment_scores import environment_scores, void_invalid_episodes
from actors.rewards.http import HTTPScorer
from actors.rewards.sandbox import SandboxScorer
from actors.rewards.scoring import (
    ColumnBinding,
    Columns,
    FunctionScorer,
    ScoreResult,
    TextScorer,
    as_number,
    finalise,
    load_function,
)
from actors.rewards.timed_call import CallTimedOut, TimedCall
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


def probe_function(spec: str, prompts: list[str], responses: list[str], key: str = "reward.function",
                   timeout_s: float = 60.0, columns: Columns | None = None, sandbox: dict | None = None) -> None:
    """Call the function once on example pairs, as the actors will; a ValueError naming
    ``key`` (reward.function, reward.gold) if it takes a column that ``columns`` (the example
    rows' other fields) lacks, raises, does not return within ``timeout_s`` (reward.timeout_s),
    does not return one number per pair, or returns no finite one.

    At run time such a function only invalidates every batch (the actor must keep
    serving), so a run would train on nothing; the driver asks first. With ``sandbox`` on
    (make_text_scorer) the probe scores in the sandbox's workers, as the replicas will: a
    function that works only in this process (not importable in a fresh one) is refused here.
    """
    fn = load_function(spec, key)
    columns = columns or {}
    binding = ColumnBinding.of(fn)
    missing = binding.missing(columns)
    if missing:
        have = ", ".join(f"'{c}'" for c in sorted(columns)) or "none besides the prompt"
        raise ValueError(f"{key} {spec!r} takes the column {', '.join(map(repr, missing))} but the prompt rows have "
                         f"no such field (their columns: {have}); add it to the data (and to data.columns if set), "
                         "or give the parameter a default")
    n = len(prompts)
    if sandbox and sandbox.get("workers", 0) > 0:
        return _probe_in_sandbox(spec, prompts, responses, key, columns, sandbox)
    try:
        out = TimedCall(lambda p, r, c: fn(p, r, **c), timeout_s, name=f"probe {spec}")(
            list(prompts), list(responses), binding.select(columns))
    except CallTimedOut:
        raise ValueError(f"{key} {spec!r} did not return within reward.timeout_s={timeout_s:g} s on a probe with "
                         f"{n} example (prompt, response) pairs; make it return sooner, or raise "
                         "reward.timeout_s") from None
    except Exception as e:  # noqa: BLE001 - user code fails in every flavour
        raise ValueError(f"{key} {spec!r} raised on a probe with {n} example (prompt, response) "
                         f"pairs: {type_and_first_line(e)}; fix the function") from None
    pairs = f"{n} example (prompt, response) pairs on a probe"
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__") or not hasattr(out, "__iter__"):
        raise ValueError(f"{key} {spec!r} returned {type(out).__name__} for {pairs}, not a list of numbers; "
                         "return one float per pair")
    items = list(out)
    if len(items) != n:
        raise ValueError(f"{key} {spec!r} returned {len(items)} scores for {n} (prompt, response) "
                         "pairs on a probe; return one float per pair, in order")
    scores = [as_number(x) for x in items]
    if n and not any(np.isfinite(scores)):  # each would be an invalid rollout: nothing to train on
        numbers = [x for x, v in zip(items, scores) if not np.isnan(v) or isinstance(x, (float, np.floating))]
        what = (f"non-finite scores ({', '.join(sorted(set(map(str, scores))))})" if len(numbers) == n else
                f"{', '.join(sorted({type(x).__name__ for x in items}))}, not a list of numbers,")
        raise ValueError(f"{key} {spec!r} returned {what} for all {pairs}; return finite floats (NaN, inf, None "
                         "or a string marks a pair invalid, and a run whose every pair is invalid trains on nothing)")


def _probe_in_sandbox(spec: str, prompts: list[str], responses: list[str], key: str, columns: Columns,
                      sandbox: dict) -> None:
    """probe_function's call through reward.sandbox: a ValueError if no example pair scores."""
    scorer = make_text_scorer(function=spec, key=key, timeout_s=float(sandbox["timeout_s"]), sandbox=sandbox)
    try:
        result = scorer.score_texts(list(prompts), list(responses), columns)
    finally:
        scorer.close()
    if prompts and not result.valid.any():
        raise ValueError(f"{key} {spec!r} scored none of {len(prompts)} example (prompt, response) pairs on a probe "
                         f"in reward.sandbox: {result.errors[0] if result.errors else 'no valid score'}; fix the "
                         "function")


def resolve_tokenizer_path(path: str) -> str:
    """A tokenizer directory has no config.json necessarily; only insist that it exists."""
    p = Path(str(path)).expanduser()
    if p.is_absolute() or str(path).startswith((".", "~")) or p.exists():
        if not p.is_dir():
            raise FileNotFoundError(f"Reward: tokenizer path {str(p)!r} does not exist")
        return str(p)
    return str(path)


class Reward:
    """Scores token batches. Exactly one of ``model`` (a sequence classifier with
    num_labels=1), ``function`` (``"module:function"`` called as
    ``fn(prompts: list[str], responses: list[str], **columns) -> list[float]``) or ``judge``
    (JudgeScorer's keyword arguments, actors/rewards/judge.py: a judge model's vLLM engine) is given.

    The function path needs ``tokenizer`` (a path) to decode tokens to text and hands the
    pairs to a text scorer (actors/rewards/scoring.py); the model path ignores it and feeds
    prompt+response token ids straight to the model, so the reward model must share the
    policy's vocabulary. ``batch_size`` bounds a model forward, which runs its sequences as one
    packed row (core/modeling/packed_rows.py) with ``packing``, else right-padded; a function is called
    once per ``score`` call. ``gold`` (a function spec, needs ``tokenizer``) is the evaluation-only
    score of ``gold_scores``: what the proxy reward stands in for. A function (or gold) call
    that does not return within ``timeout_s`` leaves its items invalid and goes on in an
    abandoned thread (actors/rewards/timed_call.py); the replica serves the next call. ``columns``: the
    prompt rows' other fields by dataset id (core/columns.py; the driver puts the table in the
    object store once and every replica gets that reference): ``score_rollouts`` and
    ``gold_scores`` look each rollout's up by its ``prompt_index`` and pass them to the text
    scorer; a reward model ignores them. ``sandbox`` ({workers, timeout_s, memory_mb};
    workers > 0) scores the function and gold one pair at a time in worker processes instead
    (actors/rewards/sandbox.py): a pair that hangs, crashes or runs out of memory is invalid, and its
    worker replaced.
    """

    def __init__(self, *, model: str | None = None, function: str | None = None,
                 tokenizer: str | None = None, batch_size: int = 16, packing: bool = True, dtype: str = "float32",
                 device: str | None = None, normalize: bool = False, gold: str | None = None,
                 timeout_s: float = 60.0, columns: PromptColumns | None = None, url: str | None = None,
                 http: dict | None = None, sandbox: dict | None = None, judge: dict | None = None,
                 from_environment: bool = False):
        fit_threads()
        if sum(x is not None for x in (model, function, url, judge)) != 1:
            raise ValueError("Reward: give exactly one of model=, function=, url= or judge= "
                             f"(got model={model!r}, function={function!r}, url={url!r}, judge={judge!r})")
        if batch_size < 1:
            raise ValueError(f"Reward: batch_size must be >= 1, got {batch_size}")
        self.batch_size, self.packing = int(batch_size), bool(packing)
        self.from_environment = bool(from_environment)  # score_rollouts passes the episodes' own scores on
        self.text_source = {"url": url} if url else {"judge": judge["model"]} if judge else {"function": function}
        self.model_path = None
        self.model = self.text_tokenizer = None
        self.normalization: tuple[float, float] | None = None  # (mean, std) applied to model scores
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.timeout_s = float(timeout_s)
        self.columns = columns if columns is not None else PromptColumns()
        self.scorer: TextScorer | None = None if model is not None else make_text_scorer(
            function=function, key="reward.function", timeout_s=timeout_s, url=url, http=http, sandbox=sandbox,
            judge=judge)
        self.gold: TextScorer | None = None if gold is None else make_text_scorer(
            function=gold, key="reward.gold", timeout_s=timeout_s, sandbox=sandbox)
        if self.scorer is not None or gold is not None:  # text rewards see decoded tokens
            if tokenizer is None:
                raise ValueError(f"Reward: {self.scorer.name if self.scorer else gold!r} needs tokenizer= (a path) "
                                 "to decode tokens")
            self.text_tokenizer = load_tokenizer(resolve_tokenizer_path(tokenizer), "Reward")
        if model is not None:
            self._load_model(model, torch_dtype(dtype, "Reward"))
            if normalize:
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
        ``from_environment``: the episodes' environment scores (actors/environments/episodes.py)."""
        if self.from_environment:
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
        else:  # the scorer's own counters (a judge's include its engine's dtype)
            source = {**self.text_source, "scorer": self.scorer.name, **self.scorer.stats()}
        return {"role": "reward", "ok": True, "pid": os.getpid(), **source, "device": str(self.device),
                "columns": list(self.columns.names), **self.stats()}



def make_text_scorer(*, function: str | None, key: str, timeout_s: float, url: str | None = None,
                     http: dict | None = None, sandbox: dict | None = None, judge: dict | None = None) -> TextScorer:
    """The text scorer of a reward setting: the server at ``url`` (``http``: reward.http's settings,
    actors/rewards/http.py); ``judge`` (JudgeScorer's keyword arguments: a judge model's engine in
    this process, actors/rewards/judge.py); or ``function`` ("module:function") called in this process,
    or, with ``sandbox`` ({workers, timeout_s, memory_mb}, workers > 0), one pair at a time in
    worker processes (actors/rewards/sandbox.py)."""
    if url is not None:
        return HTTPScorer(url, **(http or {}))
    if judge is not None:
        from actors.rewards.judge import JudgeScorer
        return JudgeScorer(**judge)
    name = f"reward function {function}" if key == "reward.function" else f"{key} {function}"
    if sandbox and sandbox.get("workers", 0) > 0:
        return SandboxScorer(function, name=name, key=key, workers=int(sandbox["workers"]),
                             timeout_s=float(sandbox["timeout_s"]), memory_mb=int(sandbox.get("memory_mb", 0)))
    return FunctionScorer(load_function(function, key), name=name, timeout_s=timeout_s)

"""Scores of (prompt, response) text pairs: the one interface every text reward implements.

A reward replica (actors/reward.py) decodes tokens to text and hands the pairs, with the
prompt rows' other columns, to a ``TextScorer``: a function in this process
(``FunctionScorer``), and the other ways a score can be had (a function in worker processes,
a server over HTTP, a judge model) implement the same three methods. They share the rules
of this module for what a valid score is: a finite number. Anything else (None, a string,
NaN, a call that raised or timed out) makes its item invalid, with a one-line message
naming the source; a scorer never raises for what the user's code did.
"""
from __future__ import annotations

import importlib
import inspect
import numbers
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

import numpy as np

from actors.rewards.timed_call import CallTimedOut, TimedCall, TooManyAbandoned
from core.infra.errors import type_and_first_line

# Column name -> one value per pair, in the pairs' order (the prompt row's other fields).
Columns = dict[str, list]


@dataclass
class ScoreResult:
    scores: np.ndarray               # [N] float32; NaN where not valid
    valid: np.ndarray                # [N] bool
    errors: list[str] = field(default_factory=list)  # one line per problem, naming its source
    failed: bool = False             # the whole call failed (raised, timed out, returned no list)
    # the call's counters, summed into the step metrics reward/<name>: timeouts (items invalid because
    # their call passed its time limit), crashes (items whose sandbox worker died), http_retries, ...
    counts: dict = field(default_factory=dict)
    # reward.sources: each source's own scores by its name, [N] float32, NaN where that source gave none
    components: dict = field(default_factory=dict)

    @property
    def n_invalid(self) -> int:
        return int((~self.valid).sum())


class TextScorer(Protocol):
    """What a reward replica asks of a text reward."""
    name: str  # for messages: "reward function mod:fn", "reward server http://..."

    def score_texts(self, prompts: list[str], responses: list[str], columns: Columns) -> ScoreResult:
        """One score per pair; ``columns`` holds the rows' other fields, each a list as long as ``prompts``."""

    def stats(self) -> dict:
        """Counters for the replica's health() (e.g. calls abandoned past their time limit)."""

    def close(self) -> None:
        """Release what the scorer holds (processes, sessions); it is not called again."""


def invalid_result(n: int, message: str) -> ScoreResult:
    """Every one of ``n`` items invalid, for one reason: a call that failed as a whole."""
    return ScoreResult(np.full(n, np.nan, np.float32), np.zeros(n, bool), [message], failed=True)


def finalise(raw: np.ndarray, source: str) -> ScoreResult:
    """float scores [N] to a ScoreResult: non-finite ones are invalid (one message counting them)."""
    raw = np.asarray(raw, dtype=np.float64)
    with np.errstate(over="ignore"):  # float64 first: an out-of-range float32 cast becomes an invalid inf
        raw = raw.astype(np.float32)
    valid = np.isfinite(raw)
    errors = []
    if not valid.all():
        bad = np.flatnonzero(~valid)
        shown = ", ".join(map(str, bad[:8].tolist())) + (", ..." if bad.size > 8 else "")
        errors.append(f"{source} returned non-finite scores for {bad.size} of {raw.size} items "
                      f"(indices {shown}); those items are invalid")
    return ScoreResult(np.where(valid, raw, np.nan).astype(np.float32), valid, errors)


def as_number(x) -> float:
    """A score item as a float; NaN (invalid) for None, strings, and what is not a real number."""
    if isinstance(x, (str, bytes)) or x is None or not isinstance(x, (numbers.Real, np.generic)):
        return float("nan")
    try:
        return float(x)
    except (TypeError, ValueError, OverflowError):
        return float("nan")


def coerce_scores(out, n: int, source: str) -> ScoreResult:
    """What a user's function returned for ``n`` pairs, as scores.

    A list (any sequence or 1-d array) of n items: each real number is its score, and an item
    that is None, a string or not a number is invalid (counted in one message). Anything else
    (not a sequence, a wrong count) invalidates all n items.
    """
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__") or not hasattr(out, "__iter__"):
        return invalid_result(n, f"{source} returned {type(out).__name__}, not a list of numbers; all {n} items "
                                 "invalid")
    items = list(out)
    if len(items) != n:
        return invalid_result(n, f"{source} returned {len(items)} scores for {n} items; all invalid")
    raw = np.array([as_number(x) for x in items], dtype=np.float64)
    not_numbers = [i for i, x in enumerate(items) if np.isnan(raw[i]) and not _is_nan(x)]
    result = finalise(raw, source)
    if not_numbers:
        kinds = sorted({type(items[i]).__name__ for i in not_numbers})
        result.errors = [f"{source} returned {', '.join(kinds)} instead of a number for {len(not_numbers)} of {n} "
                         f"items (first at index {not_numbers[0]}); those items are invalid"]
    return result


def _is_nan(x) -> bool:
    try:
        return isinstance(x, (numbers.Real, np.generic)) and np.isnan(float(x))
    except (TypeError, ValueError):
        return False


# Where the built-ins a config names by spec live now, by where they used to: an old config
# gets the new name in its error.
MOVED_MODULES = {"cluster.rewards": "actors.rewards", "cluster.envs": "actors.environments"}


def load_function(spec: str, key: str = "reward.function"):
    """Import ``"package.module:function"``; any failure is a one-line ValueError naming the
    config ``key`` and the fix."""
    module_name, sep, attr = str(spec).partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{key} {spec!r} must look like 'module:function' "
                         "(e.g. cluster.demo.sentiment:sentiment)")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - import errors of user code come in every flavour
        not_found = isinstance(e, ModuleNotFoundError) and e.name is not None and \
            (module_name == e.name or module_name.startswith(e.name + "."))
        fix = ("run from the directory that holds it or add that directory to PYTHONPATH" if not_found
               else "fix the error in that module")
        if module_name in MOVED_MODULES:
            fix = f"the built-ins moved: write {MOVED_MODULES[module_name]}:{attr}"
        raise ValueError(f"{key} {spec!r}: cannot import module {module_name!r} ({type_and_first_line(e)}); "
                         f"{fix}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{key} {spec!r}: module {module_name!r} has no callable {attr!r}; "
                         "name a function defined there")
    return fn


@dataclass(frozen=True)
class ColumnBinding:
    """Which of a prompt row's columns a reward function takes, read from its signature.

    ``f(prompts, responses)`` takes none; ``f(prompts, responses, *, answer)`` takes ``answer``
    (required: a run whose data lacks it is refused); a parameter with a default is optional;
    ``**kwargs`` takes every column.
    """
    names: frozenset[str]
    required: frozenset[str]
    takes_all: bool

    @classmethod
    def of(cls, fn: Callable) -> "ColumnBinding":
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):  # a builtin without a signature: the two lists only
            return cls(frozenset(), frozenset(), False)
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        named = [p for p in positional[2:] if p.kind is p.POSITIONAL_OR_KEYWORD] + \
                [p for p in params if p.kind is p.KEYWORD_ONLY]
        return cls(names=frozenset(p.name for p in named),
                   required=frozenset(p.name for p in named if p.default is p.empty),
                   takes_all=any(p.kind is p.VAR_KEYWORD for p in params))

    def missing(self, available: Iterable[str]) -> list[str]:
        """The required columns that ``available`` lacks, sorted."""
        return sorted(self.required - set(available))

    def select(self, columns: Columns) -> Columns:
        """The columns to pass as keyword arguments."""
        return dict(columns) if self.takes_all else {k: v for k, v in columns.items() if k in self.names}


# Abandoned calls (actors/rewards/timed_call.py) a replica keeps per function before it refuses calls.
MAX_ABANDONED_CALLS = 4


class FunctionScorer:
    """``fn(prompts, responses, **columns) -> list[float]`` called in this process, in a thread
    with a time limit (actors/rewards/timed_call.py): a call past ``timeout_s`` leaves its items invalid
    and goes on, abandoned; the replica serves the next call."""

    def __init__(self, fn: Callable, *, name: str, timeout_s: float, timeout_key: str = "reward.timeout_s"):
        self.name, self.timeout_s, self.timeout_key = name, float(timeout_s), timeout_key
        self.binding = ColumnBinding.of(fn)
        self.call = TimedCall(lambda prompts, responses, columns: fn(prompts, responses, **columns),
                              timeout_s, MAX_ABANDONED_CALLS, name=name)

    def score_texts(self, prompts: list[str], responses: list[str], columns: Columns) -> ScoreResult:
        n = len(prompts)
        try:
            out = self.call(list(prompts), list(responses), self.binding.select(columns))
        except CallTimedOut:
            result = invalid_result(n, f"{self.name} did not return within {self.timeout_key}={self.timeout_s:g} s; "
                                       f"all {n} items invalid (the call goes on in the background: "
                                       f"{self.call.abandoned} such, at most {self.call.max_abandoned})")
            result.counts["timeouts"] = n
            return result
        except TooManyAbandoned as e:
            return invalid_result(n, f"{self.name} not called: {e} ({self.timeout_key}); all {n} items invalid "
                                     "until one returns")
        except Exception as e:  # noqa: BLE001 - user code must not crash the actor
            return invalid_result(n, f"{self.name} raised {type_and_first_line(e)}; all {n} items invalid")
        return coerce_scores(out, n, self.name)

    def stats(self) -> dict:
        return {"abandoned_calls": self.call.abandoned}

    def close(self) -> None:
        pass

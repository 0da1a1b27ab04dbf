"""The start-up probe of a reward function (reward.function, reward.gold): called once on
example pairs, as the replicas will call it, so that a function that would void every batch
is refused in one line before any model loads."""
from __future__ import annotations

import numpy as np

from actors.rewards.config import RewardConfig, SandboxConfig
from actors.rewards.scoring import ColumnBinding, Columns, as_number, load_function
from actors.rewards.source import SOURCES, RewardSource
from actors.rewards.timed_call import CallTimedOut, TimedCall
from core.infra.errors import type_and_first_line


def probe_function(spec: str, prompts: list[str], responses: list[str], key: str = "reward.function",
                   timeout_s: float = 60.0, columns: Columns | None = None,
                   sandbox: SandboxConfig | None = None) -> None:
    """Call the function once on example pairs, as the actors will; a ValueError naming
    ``key`` (reward.function, reward.gold) if it takes a column that ``columns`` (the example
    rows' other fields) lacks, raises, does not return within ``timeout_s`` (reward.timeout_s),
    does not return one number per pair, or returns no finite one.

    At run time such a function only invalidates every batch (the actor must keep
    serving), so a run would train on nothing; the driver asks first. With ``sandbox`` on
    (reward.sandbox.workers > 0) the probe scores in the sandbox's workers, as the replicas will: a
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
    if sandbox is not None and sandbox.workers > 0:
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
                      sandbox: SandboxConfig) -> None:
    """probe_function's call through reward.sandbox: a ValueError if no example pair scores."""
    scorer = RewardSource(SOURCES["function"], spec).text_scorer(RewardConfig(function=spec, sandbox=sandbox),
                                                                key=key)
    try:
        result = scorer.score_texts(list(prompts), list(responses), columns)
    finally:
        scorer.close()
    if prompts and not result.valid.any():
        raise ValueError(f"{key} {spec!r} scored none of {len(prompts)} example (prompt, response) pairs on a probe "
                         f"in reward.sandbox: {result.errors[0] if result.errors else 'no valid score'}; fix the "
                         "function")

"""A judge that scores a prompt's samples together (reward.judge.mode=group): one call sees the
prompt and all n responses of its group and answers n scores.

The prompt is reward.judge.group_template filled with ``{prompt}``, ``{responses}`` (the group's
responses enumerated, "Response 1: ..." each, a blank line between), ``{n}`` and the prompt row's
columns. The reply is read by ``parse_group_scores``: a JSON list of n numbers, else numbered
lines ("1: 7", "Response 2: 3/10", "#3 - 8.5"; each index 1..n once), else n lines that each
start with a number. A reply that does not give exactly n scores leaves its whole group invalid
(one line per call counts such groups); number scores are clipped to [min_score, max_score].
Comparing the samples side by side is the point: a judge that sees them together can rank them.
"""
from __future__ import annotations

import json
import re
from typing import Optional

import numpy as np

from actors.rewards.config import template_fields
from actors.rewards.judge import JudgeScorer
from actors.rewards.scoring import Columns, ScoreResult, invalid_result

_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
# "1: 7", "Response 2: 3/10", "#3 - 8.5", "(4) 6", "Answer 5 = 2"
_NUMBERED = re.compile(r"^\W*(?:response|answer|sample|score)?\s*#?\s*\(?(\d+)\)?\**\s*"  # "Response 2", "#3"
                       rf"(?:[:)=\-]|\.(?=\s))\s*\**\s*({_NUMBER})", re.IGNORECASE)  # ": 7", ". 7" (not 1.5)
_LEADING = re.compile(rf"^\W*?({_NUMBER})")
_LIST = re.compile(r"\[[^\[\]]*\]")


GROUP_FIELDS = ("prompt", "responses", "n")


def check_group_template(template: str, columns, key: str = "reward.judge.group_template") -> None:
    """A one-line ValueError if ``template`` names a field that is neither {prompt}, {responses},
    {n} nor one of ``columns`` (the prompt rows' other fields), or a column clashes with them."""
    columns = list(columns)
    clash = sorted(set(columns) & set(GROUP_FIELDS))
    if clash:
        raise ValueError(f"the data has a column named {clash[0]!r}, which {key} cannot tell from its own "
                         f"{{{clash[0]}}}; rename that column in the data, or leave it out of data.columns")
    unknown = sorted(template_fields(template, key) - set(GROUP_FIELDS) - set(columns))
    if unknown:
        available = ", ".join([*GROUP_FIELDS, *sorted(columns)])
        raise ValueError(f"{key} names the field {', '.join(map(repr, unknown))}, which it does not have "
                         f"(available: {available}); fix the template or add the column to the data")


def enumerate_responses(responses: list[str]) -> str:
    """The group's responses as the template's ``{responses}``: "Response 1: ...", a blank line between."""
    return "\n\n".join(f"Response {k}: {r}" for k, r in enumerate(responses, 1))


def render_group(template: str, prompt: str, responses: list[str], columns: dict) -> str:
    """The judge's input for one group: ``columns`` holds the prompt row's fields (one value each)."""
    if set(columns) & set(GROUP_FIELDS):
        check_group_template("", columns)  # its one line, not a TypeError of a repeated keyword
    return template.format(**columns, prompt=prompt, responses=enumerate_responses(responses), n=len(responses))


def parse_group_scores(text: str, n: int, min_score: Optional[float] = None,
                       max_score: Optional[float] = None) -> Optional[np.ndarray]:
    """[n] float64 scores read from a group judge's reply, clipped to [min_score, max_score]; None
    when it does not give exactly n (a JSON list, numbered lines, or n lines starting with a number)."""
    listed, scores = _json_list(text, n)
    if not listed:
        listed, scores = _numbered(text, n)
    if not listed:
        lines = [m.group(1) for line in text.splitlines() if (m := _LEADING.match(line.strip()))]
        scores = [float(x) for x in lines] if len(lines) == n else None
    if scores is None or not np.all(np.isfinite(np.asarray(scores, dtype=np.float64))):
        return None
    low = -np.inf if min_score is None else min_score
    return np.clip(np.asarray(scores, dtype=np.float64), low, np.inf if max_score is None else max_score)


def _json_list(text: str, n: int) -> tuple[bool, Optional[list]]:
    """(whether the reply holds a JSON list of numbers, its n scores or None for another count)."""
    for match in _LIST.finditer(text):
        try:
            items = json.loads(match.group())
        except ValueError:
            continue
        if items and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in items):
            return True, ([float(x) for x in items] if len(items) == n else None)
    return False, None


def _numbered(text: str, n: int) -> tuple[bool, Optional[list]]:
    """(whether the reply numbers its scores, the n scores in order or None unless it numbers 1..n once each)."""
    found: dict[int, float] = {}
    for line in text.splitlines():
        m = _NUMBERED.match(line.strip())
        if m:
            k = int(m.group(1))
            if k in found:  # an index given twice: the reply does not say which score is meant
                return True, None
            found[k] = float(m.group(2))
    if not found:
        return False, None
    return True, ([found[k] for k in range(1, n + 1)] if sorted(found) == list(range(1, n + 1)) else None)


def group_members(groups) -> list[np.ndarray]:
    """The pair indices of each group, groups in order of first appearance (``groups`` [N] ids)."""
    groups = np.asarray(groups)
    _, first = np.unique(groups, return_index=True)
    return [np.flatnonzero(groups == groups[i]) for i in sorted(first)]


class GroupJudgeScorer(JudgeScorer):
    """A JudgeScorer that judges each group of pairs in one call (module docstring)."""

    def __init__(self, config, *, dtype: str | None = None, seed: int = 0):
        super().__init__(config, dtype=dtype, seed=seed)
        self.group_template = config.group_template

    def score_texts(self, prompts: list[str], responses: list[str], columns: Columns,
                    groups=None) -> ScoreResult:
        """One score per pair; ``groups`` [N]: which pairs are samples of one prompt (None: the
        pairs of one prompt text)."""
        n = len(prompts)
        members = group_members(np.unique(prompts, return_inverse=True)[1] if groups is None else groups)
        try:
            texts = [render_group(self.group_template, prompts[m[0]], [responses[i] for i in m],
                                  {k: v[m[0]] for k, v in columns.items()}) for m in members]
        except (KeyError, IndexError, AttributeError, TypeError, ValueError) as e:
            return invalid_result(n, f"{self.name}: cannot fill reward.judge.group_template ({type(e).__name__}: "
                                     f"{e}); all {n} items invalid")
        fits, replies = self.generate(texts)
        result, unread = ScoreResult(np.full(n, np.nan, np.float32), np.zeros(n, bool)), []
        for g, reply in zip(fits, replies):
            read = parse_group_scores(reply, len(members[g]), self.min_score, self.max_score)
            if read is None:
                unread.append((len(members[g]), reply))
            else:
                result.scores[members[g]], result.valid[members[g]] = read.astype(np.float32), True
        if unread:
            size, text = unread[0]
            result.errors.append(f"{self.name}: {len(unread)} of {len(members)} groups' verdicts did not give one "
                                 f"score per response (first, for {size} responses: {text[:80]!r}); those groups "
                                 "are invalid (raise reward.judge.max_new_tokens if the replies are cut)")
        if len(fits) < len(members):
            result.errors.insert(0, f"{self.name}: {len(members) - len(fits)} of {len(members)} rendered group "
                                    f"templates do not fit reward.judge.engine.max_model_len={self.max_model_len} "
                                    f"with max_new_tokens={self.params.max_tokens}; those groups are invalid (raise "
                                    "max_model_len)")
        return result

"""``math``: a response scored 1.0 when its final answer is equivalent to the row's answer (Math-Verify).

Hugging Face's Math-Verify extracts the last answer from free text (``\\boxed{}``, ``$...$``, a
plain number, ``#### 72``) and compares it with the gold one symbolically, so ``1/2``,
``0.5`` and ``\\frac{1}{2}`` agree. Its time limit is ``signal.alarm``, which works only in a
process's main thread: elsewhere Math-Verify raises, or, from code that catches that, scores 0
for what it never compared. So this module arms Math-Verify's limit only in the main thread
(a reward.sandbox worker calls it there) and passes none in any other thread (the replica's
timed call, reward.timeout_s, bounds it there). A pair whose parse or comparison ran out of
time is invalid (None), never a silent 0.0; so is a row whose gold answer cannot be read.
"""
from __future__ import annotations

import logging
import threading

from math_verify import parse, verify
from math_verify.errors import TimeoutException

log = logging.getLogger(__name__)
# Math-Verify warns once per process that a call without a limit must be bounded by the caller, and on each
# of its timeouts; the first is this module's design (see above), the second is logged here, once per pair.
for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).setLevel(logging.ERROR)

# Seconds Math-Verify may spend on one parse or one comparison (its own default is 5).
STEP_TIMEOUT_S = 5


def gold_text(answer) -> str | None:
    """The gold answer as text Math-Verify parses: a number as written, a LaTeX string as is, a
    GSM8K solution's part after its last ``####`` with thousands commas dropped; None if absent."""
    if answer is None or isinstance(answer, bool):
        return None
    if isinstance(answer, int):
        return str(answer)
    if isinstance(answer, float):
        return repr(answer) if answer == answer else None  # NaN: no answer
    text = str(answer)
    if "####" in text:
        text = text.rsplit("####", 1)[1].replace(",", "")
    text = text.strip()
    return text or None


def _limit() -> int | None:
    """Math-Verify's time limit here: armed only where signal.alarm works (the main thread)."""
    return STEP_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _parse(text: str, limit: int | None) -> list:
    """Math-Verify's extraction of ``text``: [] when it finds nothing or fails; TimeoutException passes."""
    try:
        return parse(text, parsing_timeout=limit, raise_on_error=True)
    except Exception:  # noqa: BLE001 - unparseable text is a wrong answer, not an error
        return []


def score_pair(response: str, answer) -> float | None:
    """1.0 if ``response``'s final answer is equivalent to ``answer``, 0.0 if not, None (invalid)
    when the gold answer is unreadable or a parse or comparison ran out of time."""
    gold_str = gold_text(answer)
    if gold_str is None:
        return None
    limit = _limit()
    try:
        gold = _parse(gold_str, limit) or _parse(f"${gold_str}$", limit)
        if not gold:
            return None
        predicted = _parse(str(response or ""), limit)
        if not predicted:
            return 0.0
        try:
            return float(verify(gold, predicted, timeout_seconds=limit, raise_on_error=True))
        except Exception:  # noqa: BLE001 - expressions that do not compare are not equal
            return 0.0
    except TimeoutException:
        log.warning("actors.rewards:math: Math-Verify ran past %d s on a pair; it is invalid", STEP_TIMEOUT_S)
        return None


def math(prompts: list[str], responses: list[str], *, answer: list) -> list[float | None]:
    """One score per pair: 1.0 when the response's final answer is equivalent to the row's
    ``answer`` (Math-Verify), 0.0 when not, None (an invalid pair) when that could not be decided."""
    return [score_pair(r, a) for r, a in zip(responses, answer)]

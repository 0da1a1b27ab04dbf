"""actors.rewards:math scores a response's final answer against the row's answer, by equivalence
(Math-Verify), in the main thread (a sandbox worker) and in any other thread (the replica's timed call)."""
import threading

import pytest

import actors.rewards.math_answer as math_answer
from actors.rewards import math

pytestmark = pytest.mark.unit

GSM8K_SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"

CASES = [  # (response, answer, expected)
    ("The answer is \\boxed{72}.", 72, 1.0),
    ("She sold 72 clips altogether.", GSM8K_SOLUTION, 1.0),
    ("Natalia sold 24 clips in May, so 48 + 24 = 72.\n#### 72", GSM8K_SOLUTION, 1.0),
    ("In total: 1,234 dollars.", "So the total is 1,234.\n#### 1,234", 1.0),
    ("#### 1234", "#### 1,234", 1.0),
    ("x = 1/2", "\\frac{1}{2}", 1.0),
    ("The probability is $0.5$.", "$\\frac{1}{2}$", 1.0),
    ("\\boxed{\\frac{3}{4}}", 0.75, 1.0),
    ("\\boxed{-3}", -3, 1.0),
    ("The answer is 71.", 72, 0.0),
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
    ("#### 1,235", "#### 1,234", 0.0),
    ("I do not know, sorry!", 72, 0.0),
    ("}{\\\\boxed{{{ $$ ####", 72, 0.0),
    ("", 72, 0.0),
    ("The answer is 72.", None, None),          # no gold answer: the pair is invalid, not 0
    ("The answer is 72.", "", None),
    ("The answer is 72.", "#### ", None),
]


def _score(cases):
    return math([""] * len(cases), [c[0] for c in cases], answer=[c[1] for c in cases])


def test_the_table_in_the_main_thread():
    assert _score(CASES) == [c[2] for c in CASES]


def test_the_table_in_another_thread_where_no_signal_can_be_armed():
    """Math-Verify's signal.alarm raises off the main thread; armed there it would score every pair 0."""
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("scores", _score(CASES)))
    thread.start()
    thread.join()
    assert out["scores"] == [c[2] for c in CASES]


def test_a_comparison_past_the_limit_is_invalid_not_wrong(monkeypatch):
    """A tower of powers keeps sympy busy past any limit: None (invalid), never a silent 0.0."""
    monkeypatch.setattr(math_answer, "STEP_TIMEOUT_S", 1)
    assert math_answer.score_pair("\\boxed{9^{9^{9^{9}}}}", 2) is None


@pytest.mark.parametrize("answer, text", [(72, "72"), (0.5, "0.5"), ("  #### 1,234,567 ", "1234567"),
                                          ("\\frac{1}{2}", "\\frac{1}{2}"), (None, None), (True, None),
                                          (float("nan"), None)])
def test_gold_text(answer, text):
    assert math_answer.gold_text(answer) == text

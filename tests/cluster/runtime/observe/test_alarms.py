"""The over-optimisation alarms on hand-made metric sequences."""
import math

import pytest

from cluster.runtime.observe.alarms import OveroptimizationAlarm, alarm_words
from cluster.runtime.observe.metrics import progress_line

pytestmark = pytest.mark.unit


def feed(alarm, rows):
    return [alarm.update(step, row) for step, row in enumerate(rows, start=1)]


def evals(proxy, gold):
    return [{"eval/score_mean": p, "eval/gold_score": g} for p, g in zip(proxy, gold)]


def test_proxy_up_gold_down_needs_three_evaluations_moving_apart():
    out = feed(OveroptimizationAlarm(window=10), evals([0.1, 0.5, 0.9, 1.4], [0.2, 0.3, 0.1, -0.2]))
    assert [o["alarm/proxy_up_gold_down"] for o in out] == [0, 0, 0, 1]  # 0.3 > 0.1 > -0.2 while proxy rises
    both_rise = feed(OveroptimizationAlarm(window=10), evals([0.1, 0.5, 0.9], [0.1, 0.2, 0.3]))
    assert both_rise[-1]["alarm/proxy_up_gold_down"] == 0
    noisy = feed(OveroptimizationAlarm(window=10), evals([0.1, 0.5, 0.9], [0.3, 0.1, 0.2]))  # not monotonic
    assert noisy[-1]["alarm/proxy_up_gold_down"] == 0


def test_steps_without_evaluation_keep_the_last_verdict_inputs():
    alarm = OveroptimizationAlarm(window=10)
    rows = [{"eval/score_mean": 0.0, "eval/gold_score": 1.0}, {}, {"eval/score_mean": 1.0, "eval/gold_score": 0.5},
            {}, {"eval/score_mean": 2.0, "eval/gold_score": 0.0}]
    out = feed(alarm, rows)
    assert out[-1]["alarm/proxy_up_gold_down"] == 1
    assert "alarm/proxy_up_gold_down" not in feed(OveroptimizationAlarm(window=10), [{}])[0]  # no gold: no key


def test_kl_up_entropy_down_over_the_window():
    kl = [0.2 + 0.1 * i for i in range(5)]          # 0.2 -> 0.6: x3, above the floor
    entropy = [2.0 - 0.3 * i for i in range(5)]     # 2.0 -> 0.8: below 80%
    rows = [{"kl/mean": k, "ppo/entropy": e, "response/length_mean": 8} for k, e in zip(kl, entropy)]
    out = feed(OveroptimizationAlarm(window=5), rows)
    assert [o["alarm/kl_up_entropy_down"] for o in out] == [0, 0, 0, 0, 1]  # needs a full window
    steady = [{**r, "ppo/entropy": 2.0} for r in rows]
    assert feed(OveroptimizationAlarm(window=5), steady)[-1]["alarm/kl_up_entropy_down"] == 0
    tiny = [{**r, "kl/mean": r["kl/mean"] / 100} for r in rows]  # x3 but 0.006 nats: below the floor
    assert feed(OveroptimizationAlarm(window=5), tiny)[-1]["alarm/kl_up_entropy_down"] == 0


def test_length_drift_against_the_first_window():
    rows = [{"response/length_mean": n} for n in [8, 8, 8, 8, 9, 10, 12, 13, 14]]
    out = feed(OveroptimizationAlarm(window=4), rows)
    # first full window (steps 1-4) means 8; the last three steps average 11.7 at step 8 (within
    # 8 * 1.5 = 12), 13 at step 9
    assert [o["alarm/length_drift"] for o in out] == [0, 0, 0, 0, 0, 0, 0, 0, 1]


def test_a_rollback_drops_the_steps_it_redoes():
    alarm = OveroptimizationAlarm(window=10)
    feed(alarm, evals([0.1, 0.5, 0.9], [0.3, 0.2, 0.1]))
    # steps 2-3 are redone after a rollback to step 1, now with the gold score rising
    assert alarm.update(2, evals([0.5], [0.4])[0])["alarm/proxy_up_gold_down"] == 0
    assert alarm.update(3, evals([0.9], [0.5])[0])["alarm/proxy_up_gold_down"] == 0


def test_off_and_non_finite_values():
    assert OveroptimizationAlarm(window=0).update(1, {"kl/mean": 1.0}) == {}
    out = feed(OveroptimizationAlarm(window=2), [{"kl/mean": math.nan, "ppo/entropy": 1.0}] * 3)
    assert out[-1]["alarm/kl_up_entropy_down"] == 0


def test_progress_line_shows_raised_alarms():
    assert alarm_words({"alarm/length_drift": 0.0}) == ""
    line = progress_line(5, 10, {"reward/mean": 1.0, "alarm/proxy_up_gold_down": 1.0,
                                 "alarm/length_drift": 1.0}, 5.0)
    assert line.endswith("| ALARM proxy up, gold down; length drift")

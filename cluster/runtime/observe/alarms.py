"""Over-optimisation alarms: the signals that a policy is hacking its reward.

With a gold score (``reward.gold``, scored at evaluation only) the evidence is direct: the
proxy reward on held-out prompts keeps rising while the gold score falls. Without one, the
alarm watches what usually comes with reward hacking: the KL to the reference climbing
while the policy's entropy collapses (it has found one thing the reward likes and repeats
it), and the response length drifting far from where it started (longer or shorter
answers that the reward model happens to prefer). Each alarm is a 0/1 metric per step.
The thresholds are heuristics, stated in docs/metrics.md; an alarm is a reason to look at
samples.jsonl, not a verdict.
"""
from __future__ import annotations

import math
from typing import Optional

GOLD_EVALS = 3             # evaluations the proxy-up-gold-down test spans
KL_RISE = 1.5              # KL at the end of the window above this multiple of its start ...
KL_FLOOR = 0.1             # ... and above this many nats (tiny KLs rise by large factors)
ENTROPY_FALL = 0.8         # entropy at the end below this fraction of its start
LENGTH_DRIFT = 0.5         # response length moved by more than this fraction of its starting mean


def monotonic(values: list, rising: bool) -> bool:
    """Strictly rising (or falling) through every value."""
    pairs = list(zip(values, values[1:]))
    return bool(pairs) and all((b > a) if rising else (b < a) for a, b in pairs)


class OveroptimizationAlarm:
    """Per-step alarms over a window of ``window`` steps (and the last GOLD_EVALS evaluations).

    ``update(step, metrics)`` returns the ``alarm/*`` metrics of that step. Steps must come in
    order; a step at or before one already seen (a rollback redoing steps) drops the later ones.
    """

    def __init__(self, window: int = 10) -> None:
        self.window = window
        self.steps: list[tuple[int, dict]] = []    # (step, {kl, entropy, length})
        self.evals: list[tuple[int, float, float]] = []  # (step, proxy on held-out prompts, gold)
        self.first_length: Optional[float] = None  # mean response length over the first window

    def update(self, step: int, metrics: dict) -> dict:
        if self.window <= 0:
            return {}
        self.steps = [s for s in self.steps if s[0] < step]
        self.evals = [e for e in self.evals if e[0] < step]
        self.steps.append((step, {k: _num(metrics.get(key)) for k, key in
                                  (("kl", "kl/mean"), ("entropy", "ppo/entropy"), ("length", "response/length_mean"))}))
        proxy, gold = _num(metrics.get("eval/score_mean")), _num(metrics.get("eval/gold_score"))
        if proxy is not None and gold is not None:
            self.evals.append((step, proxy, gold))
        out = {"alarm/kl_up_entropy_down": float(self._kl_up_entropy_down()),
               "alarm/length_drift": float(self._length_drift())}
        if self.evals:
            out["alarm/proxy_up_gold_down"] = float(self._proxy_up_gold_down())
        return out

    def _recent(self, key: str) -> list[float]:
        values = [s[1][key] for s in self.steps[-self.window:]]
        return values if len(self.steps) >= self.window and None not in values else []

    def _kl_up_entropy_down(self) -> bool:
        kl, entropy = self._recent("kl"), self._recent("entropy")
        if not kl or not entropy:
            return False
        return (kl[-1] > KL_FLOOR and kl[-1] > KL_RISE * max(kl[0], 0.0)
                and entropy[-1] < ENTROPY_FALL * entropy[0])

    def _length_drift(self) -> bool:
        lengths = self._recent("length")
        if not lengths:
            return False
        if self.first_length is None:
            self.first_length = sum(lengths) / len(lengths)
            return False
        current = sum(lengths[-3:]) / len(lengths[-3:])
        return abs(current - self.first_length) > LENGTH_DRIFT * max(self.first_length, 1.0)

    def _proxy_up_gold_down(self) -> bool:
        recent = self.evals[-GOLD_EVALS:]
        if len(recent) < GOLD_EVALS:
            return False
        return monotonic([e[1] for e in recent], rising=True) and monotonic([e[2] for e in recent], rising=False)


def alarm_words(metrics: dict) -> str:
    """The progress line's note for the alarms raised this step ('' when none)."""
    names = {"alarm/proxy_up_gold_down": "proxy up, gold down",
             "alarm/kl_up_entropy_down": "KL up, entropy down",
             "alarm/length_drift": "length drift"}
    raised = [text for key, text in names.items() if metrics.get(key) == 1.0]
    return "ALARM " + "; ".join(raised) if raised else ""


def _num(value) -> Optional[float]:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None

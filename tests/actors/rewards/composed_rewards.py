"""Reward functions for the composed-reward tests, imported by spec (composed_rewards:ones)."""
import threading

# Two sources that each wait for the other: they return only when scored at the same time.
MEETING = threading.Barrier(2, timeout=30)


def ones(prompts, responses):
    return [1.0] * len(responses)


def lengths(prompts, responses):
    return [float(len(r)) for r in responses]


def nan_at_first(prompts, responses):
    return [float("nan")] + [0.5] * (len(responses) - 1)


def meets_a(prompts, responses):
    MEETING.wait()
    return [1.0] * len(responses)


def meets_b(prompts, responses):
    MEETING.wait()
    return [2.0] * len(responses)

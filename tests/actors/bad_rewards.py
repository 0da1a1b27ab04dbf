"""Deliberately misbehaving reward functions for tests/actors/test_reward.py."""
import math


def nan_for_odd(prompts, responses):
    return [math.nan if i % 2 else 1.0 for i in range(len(responses))]


def raising(prompts, responses):
    raise RuntimeError("reward service unavailable\nsecond line that must not show")


def wrong_length(prompts, responses):
    return [0.0]


def not_numbers(prompts, responses):
    return ["high"] * len(responses)


def length_of_response(prompts, responses):
    return [float(len(r)) for r in responses]

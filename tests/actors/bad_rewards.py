"""Deliberately misbehaving reward functions for tests/actors/test_reward.py."""
import math
import threading


def nan_for_odd(prompts, responses):
    return [math.nan if i % 2 else 1.0 for i in range(len(responses))]


def raising(prompts, responses):
    raise RuntimeError("reward service unavailable\nsecond line that must not show")


def wrong_length(prompts, responses):
    return [0.0]


def not_numbers(prompts, responses):
    return ["high"] * len(responses)


def some_not_numbers(prompts, responses):
    return [1, None, 2.0, "3", None][:len(responses)]


def length_of_response(prompts, responses):
    return [float(len(r)) for r in responses]


# Set by a test to let the calls that hang_when_asked holds return.
RELEASE = threading.Event()


def hangs_when_asked(prompts, responses):
    """Hangs (until RELEASE is set) on a batch with a response that says "hang"; else scores lengths."""
    if any("hang" in r for r in responses):
        RELEASE.wait(600)
    return length_of_response(prompts, responses)

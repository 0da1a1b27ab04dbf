"""Reward functions that take their time: slow enough that a test can kill the reward actor while it
scores, or never returning (reward.timeout_s)."""
import time

from cluster.demo.sentiment import sentiment
from cluster.runtime.prepare import PROBE_RESPONSES

SECONDS = 0.5


def slow_sentiment(prompts, responses):
    time.sleep(SECONDS)
    return sentiment(prompts, responses)


def hangs_after_probe(prompts, responses):
    """Scores the start-up probe's example pairs; never returns on any other call."""
    if list(responses) == list(PROBE_RESPONSES[:len(responses)]):
        return sentiment(prompts, responses)
    time.sleep(3600)
    return sentiment(prompts, responses)

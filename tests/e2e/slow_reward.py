"""A reward function slow enough that a test can kill the reward actor while it scores."""
import time

from cluster.demo.sentiment import sentiment

SECONDS = 0.5


def slow_sentiment(prompts, responses):
    time.sleep(SECONDS)
    return sentiment(prompts, responses)

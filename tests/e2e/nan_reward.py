"""A reward function that passes the start-up probe and then scores nearly everything NaN."""
import math

from cluster.demo.sentiment import sentiment
from cluster.runtime.prepare import PROBE_RESPONSES


def nan_after_probe(prompts, responses):
    """The probe's example pairs get real scores; one response in eight after that does too."""
    scores = sentiment(prompts, responses)
    if list(responses) == list(PROBE_RESPONSES[:len(responses)]):
        return scores
    return [s if i % 8 == 0 else math.nan for i, s in enumerate(scores)]

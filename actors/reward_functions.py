"""Built-in reward functions, usable as ``Reward(function="actors.reward_functions:NAME")``.

Every function has the reward-function signature
``fn(prompts: list[str], responses: list[str]) -> list[float]``.
"""
from __future__ import annotations

import re

# The demo's sentiment lexicon; cluster.tiny_models builds its corpus from these words.
POSITIVE_WORDS = ("good", "great", "happy", "kind", "bright", "warm", "lovely", "calm",
                  "brave", "joyful", "gentle", "wonderful", "sweet", "fine", "glad")
NEGATIVE_WORDS = ("bad", "sad", "dark", "cold", "angry", "grim", "awful", "cruel",
                  "dull", "bitter", "gloomy", "harsh", "weak", "sour", "lonely")
_POSITIVE = frozenset(POSITIVE_WORDS)
_NEGATIVE = frozenset(NEGATIVE_WORDS)
_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")

# The tiny corpus has clauses of ~4 words with one sentiment word each, so a scale of 4
# puts a typical clause at about +-1, the range PPO's default hyperparameters expect.
SENTIMENT_SCALE = 4.0


def sentiment(prompts: list[str], responses: list[str]) -> list[float]:
    """Lexicon sentiment of each response (its prompt is ignored).

    score = (#positive words - #negative words) / max(1, #words) * SENTIMENT_SCALE,
    with words lower-cased and matched against the demo vocabulary of
    cluster.tiny_models. Dividing by length means padding a reply with neutral words
    does not pay, and repeating one positive word earns at most SENTIMENT_SCALE.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"sentiment: {len(prompts)} prompts but {len(responses)} responses")
    scores = []
    for text in responses:
        words = _WORD.findall(text.lower())
        pos = sum(w in _POSITIVE for w in words)
        neg = sum(w in _NEGATIVE for w in words)
        scores.append((pos - neg) / max(1, len(words)) * SENTIMENT_SCALE)
    return scores

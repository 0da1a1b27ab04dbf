"""The built-in demo's task: say something positive. Its vocabulary, its reward and its hidden preferences.

Everything the demo's sentiment task knows lives here, so the corpus, the prompts, the reward
and the labeller agree on one vocabulary:
- the vocabulary: the sentiment lexicon and the sentence parts of its sentences;
- the built-in text made of them: the corpus the tiny tokenizer and policy are trained on
  (``corpus``), the PPO prompts (``builtin_prompts``) and the SFT / reward-model rows
  (``builtin_rows``), each deterministic for its seed;
- ``sentiment``: the lexicon reward, usable as ``reward.function: cluster.demo.sentiment:sentiment``;
- ``gold``: the hidden labeller of the miniature RLHF recipe (cluster/recipes/pipeline.py).
  It labels pairs of the SFT model's samples, the proxy reward model learns from those few
  labels, and PPO optimises the proxy while the gold score is tracked on held-out prompts
  (``reward.gold``), never trained on.

Gold = the lexicon sentiment minus a penalty for repeated words. The SFT model's samples
("happy in the park.") hardly ever repeat a word, so a proxy fitted to a few dozen of their
pairs learns "positive words are good" and nothing about repetition: the feature the proxy
misses, and the one a policy pushed too far from the SFT model finds ("happy happy glad happy").

Every scorer has the reward-function signature
``fn(prompts: list[str], responses: list[str]) -> list[float]``.
"""
from __future__ import annotations

import math
import random
import re

# The sentiment lexicon: the scorer's words, and the corpus's.
POSITIVE_WORDS = ("good", "great", "happy", "kind", "bright", "warm", "lovely", "calm",
                  "brave", "joyful", "gentle", "wonderful", "sweet", "fine", "glad")
NEGATIVE_WORDS = ("bad", "sad", "dark", "cold", "angry", "grim", "awful", "cruel",
                  "dull", "bitter", "gloomy", "harsh", "weak", "sour", "lonely")
_POSITIVE = frozenset(POSITIVE_WORDS)
_NEGATIVE = frozenset(NEGATIVE_WORDS)
WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")

# The tiny corpus has clauses of ~4 words with one sentiment word each, so a scale of 4
# puts a typical clause at about +-1, the range PPO's default hyperparameters expect.
SENTIMENT_SCALE = 4.0


def sentiment(prompts: list[str], responses: list[str]) -> list[float]:
    """Lexicon sentiment of each response (its prompt is ignored).

    score = (#positive words - #negative words) / max(1, #words) * SENTIMENT_SCALE,
    with words lower-cased and matched against the lexicon above. Dividing by length means
    padding a reply with neutral words does not pay, and repeating one positive word earns at
    most SENTIMENT_SCALE.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"sentiment: {len(prompts)} prompts but {len(responses)} responses")
    scores = []
    for text in responses:
        words = WORD.findall(text.lower())
        pos = sum(w in _POSITIVE for w in words)
        neg = sum(w in _NEGATIVE for w in words)
        scores.append((pos - neg) / max(1, len(words)) * SENTIMENT_SCALE)
    return scores


def is_positive(prompts: list[str], responses: list[str]) -> list[float]:
    """1.0 for a response with more positive than negative lexicon words, else 0.0: a
    pass/fail reward, as verifiable tasks give, where a prompt's samples often all score
    alike (what dynamic sampling, ppo.filter_groups, leaves out)."""
    return [1.0 if s > 0 else 0.0 for s in sentiment(prompts, responses)]


# Sentence parts of the demo corpus and prompts; each clause carries one lexicon word.
SUBJECTS = ("the cat", "a dog", "my friend", "the old man", "the child", "a bird", "the town",
             "our teacher", "the river", "the garden", "a sailor", "the queen", "the baker")
VERBS = ("was", "seemed", "felt", "looked", "became", "stayed")
PLACES = ("in the morning", "by the sea", "at night", "after the rain", "in the park",
           "near the hill", "on the road", "at home", "in winter", "in spring")
LINKS = ("and", "but", "so", "because", "while")


def corpus(n_sentences: int = 2000, seed: int = 0, words: tuple = POSITIVE_WORDS + NEGATIVE_WORDS) -> list[str]:
    """A deterministic built-in English-like corpus mixing positive and negative sentences (each
    clause's sentiment word drawn from ``words``: POSITIVE_WORDS alone gives positive sentences)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_sentences):
        clause = lambda: f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(words)}"
        s = clause()
        if rng.random() < 0.5:
            s += f" {rng.choice(PLACES)}"
        if rng.random() < 0.4:
            s += f" {rng.choice(LINKS)} {clause()}"
        lines.append(s[0].upper() + s[1:] + ".")
    return lines


def builtin_prompts(n: int = 320, seed: int = 0) -> list[str]:
    """Deterministic sentence starts in the corpus' style, for the sentiment demo.

    First every "<Subject> <verb>" pair of the corpus grammar ("The cat was", "My friend
    felt", ...: 78 of them), then compound starts that stop at the linking word ("The
    river stayed gloomy and") or where the second clause needs its sentiment word ("A dog
    felt calm at night but the child seemed"), until there are `n` distinct prompts. The
    policy completes the sentence; the sentiment reward (which reads only the response)
    pays for the words it picks.
    """
    if n < 1:
        raise ValueError(f"builtin_prompts: n must be >= 1, got {n}")
    cap = lambda s: s[0].upper() + s[1:]
    out = [cap(f"{s} {v}") for s in SUBJECTS for v in VERBS]
    seen = set(out)
    rng = random.Random(seed)
    words = POSITIVE_WORDS + NEGATIVE_WORDS
    while len(out) < n:
        s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(words)}"
        if rng.random() < 0.5:
            s += f" {rng.choice(PLACES)}"
        s += f" {rng.choice(LINKS)}"
        if rng.random() < 0.6:
            s += f" {rng.choice(SUBJECTS)} {rng.choice(VERBS)}"
        s = cap(s)
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out[:n]


def completion(rng: random.Random, words) -> str:
    s = f" {rng.choice(words)}"
    if rng.random() < 0.6:
        s += f" {rng.choice(PLACES)}"
    return s + "."


def builtin_rows(kind: str, n: int = 384, seed: int = 0) -> list[dict]:
    """Deterministic tiny rows in the corpus' style: prompts are "<Subject> <verb>" starts.

    "sft": {"prompt", "response"} with a positive completion (" happy in the park."), so
    SFT visibly moves the pre-trained policy towards positive words. "rm": {"prompt",
    "chosen", "rejected"}: a positive completion preferred to a negative one.
    """
    rng = random.Random(seed)
    starts = [f"{s} {v}" for s in SUBJECTS for v in VERBS]
    rows = []
    for _ in range(n):
        prompt = rng.choice(starts)
        prompt = prompt[0].upper() + prompt[1:]
        if kind == "sft":
            rows.append({"prompt": prompt, "response": completion(rng, POSITIVE_WORDS)})
        else:
            rows.append({"prompt": prompt, "chosen": completion(rng, POSITIVE_WORDS),
                         "rejected": completion(rng, NEGATIVE_WORDS)})
    return rows


# Weight of the repeated-word fraction, in units of SENTIMENT_SCALE: with 2, four copies of
# one positive word (repeated fraction 3/4) score 4 - 6 = -2, below any neutral sentence (0).
REPEAT_PENALTY = 2.0


def repeated_fraction(text: str) -> float:
    """Share of the words that repeat an earlier word of the text (0 when all differ)."""
    words = WORD.findall(text.lower())
    return 1.0 - len(set(words)) / len(words) if words else 0.0


def gold(prompts: list[str], responses: list[str]) -> list[float]:
    """sentiment(response) - REPEAT_PENALTY * SENTIMENT_SCALE * repeated_fraction(response).

    The reward-function signature (usable as ``reward.gold`` or ``reward.function``); the
    prompt is ignored, as sentiment ignores it.
    """
    base = sentiment(prompts, responses)  # also checks the lengths match
    return [s - REPEAT_PENALTY * SENTIMENT_SCALE * repeated_fraction(r) for s, r in zip(base, responses)]


def label_pairs(prompt: str, responses: list[str], scores: list[float], *, max_pairs: int, labels: str,
                rng: random.Random) -> tuple[list[dict], int]:
    """Preference pairs among one prompt's sampled responses, labelled by their gold scores.

    Candidate pairs are the unordered pairs of distinct response texts whose gold scores
    differ (a tie or a duplicate says nothing about preference); ``max_pairs`` of them are
    drawn at random. ``labels="hard"``: the higher gold score is chosen. ``labels=
    "bradley_terry"``: the first is chosen with probability sigmoid(gold_a - gold_b), a noisy
    labeller. Returns (rows {"prompt", "chosen", "rejected", "gold_chosen", "gold_rejected"},
    number of candidate pairs skipped as ties or duplicates).
    """
    if len(responses) != len(scores):
        raise ValueError(f"label_pairs: {len(responses)} responses but {len(scores)} scores")
    if labels not in ("hard", "bradley_terry"):
        raise ValueError(f"label_pairs: labels={labels!r} is unknown; use 'hard' or 'bradley_terry'")
    candidates, skipped = [], 0
    for i in range(len(responses)):
        for j in range(i + 1, len(responses)):
            if responses[i] == responses[j] or scores[i] == scores[j]:
                skipped += 1
            else:
                candidates.append((i, j))
    rows = []
    for i, j in rng.sample(candidates, min(max_pairs, len(candidates))):
        if labels == "hard":
            first = scores[i] > scores[j]
        else:
            first = rng.random() < 1.0 / (1.0 + math.exp(scores[j] - scores[i]))
        a, b = (i, j) if first else (j, i)
        rows.append({"prompt": prompt, "chosen": responses[a], "rejected": responses[b],
                     "gold_chosen": scores[a], "gold_rejected": scores[b]})
    return rows, skipped

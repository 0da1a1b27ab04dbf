"""Reward functions that take prompt-row columns, for tests/actors/test_reward_columns.py."""


def answer_echo(prompts, responses, *, answer):
    """Scores each pair with its row's answer: what reached it, checked by the test."""
    return [float(a) for a in answer]


def answer_plus_bonus(prompts, responses, answer, bonus=None):
    """``bonus`` is optional: a row without one gets None."""
    return [float(a) + (b or 0.0) for a, b in zip(answer, bonus or [None] * len(answer))]

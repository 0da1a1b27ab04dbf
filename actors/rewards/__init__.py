"""Rewards: every source a run can score with, in one room.

    source.py               which source scores a run (function | model | url | judge | environment)
    scoring.py              the text-scorer interface, a function's scorer, score results
    sandbox.py, http.py,    a function in worker processes, a reward server, a judge model
    judge.py
    environment_scores.py   the episodes' own scores (env.reward: environment)
    config.py               reward.http, reward.sandbox and reward.judge
    math_answer.py          the built-in math verifier
    reasoning_gym_answer.py reasoning-gym's tasks by their own verifiers

Built-in rewards a config names by spec: ``reward.function: actors.rewards:math``.

    math   1.0 when the response's final answer equals the row's ``answer`` column (a number, a LaTeX
           expression, or a GSM8K solution ending in ``#### 72``), compared by Math-Verify; else 0.0
    reasoning_gym   a reasoning-gym task's own verifier on each response's answer (rows made by
                    cluster.data.reasoning_gym, with their ``rg_task`` and ``rg_entry`` columns)
"""

__all__ = ["math", "reasoning_gym"]


def __getattr__(name: str):
    # Imported on first use: Math-Verify loads only in a process that scores with it.
    if name == "math":
        from actors.rewards.math_answer import math
        return math
    if name == "reasoning_gym":
        from actors.rewards.reasoning_gym_answer import reasoning_gym
        return reasoning_gym
    raise AttributeError(f"module 'actors.rewards' has no attribute {name!r}")

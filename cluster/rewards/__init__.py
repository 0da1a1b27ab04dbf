"""Built-in rewards a config names by spec: ``reward.function: cluster.rewards:math``.

    math   1.0 when the response's final answer equals the row's ``answer`` column (a number, a LaTeX
           expression, or a GSM8K solution ending in ``#### 72``), compared by Math-Verify; else 0.0
"""
from cluster.rewards.math_answer import math

__all__ = ["math"]

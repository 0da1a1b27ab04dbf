"""The calculator tool and the tool environment built on it.

``calculator(expression)`` evaluates arithmetic safely: numbers, + - * / // % **, unary minus
and parentheses, nothing else (no names, no calls, no attribute access), with bounded exponents
and operand sizes, so no expression a policy writes can hang or exhaust the worker.
``Calculator`` is a ToolEnvironment (actors/environments/tools.py) with that one tool, whose final
answer scores 1.0 when its last number equals the prompt row's ``answer`` column (a number, or
GSM8K's worked solution ending "#### <number>").
"""
from __future__ import annotations

import ast
import operator
import re

from actors.environments.tools import ToolEnvironment

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
MAX_EXPONENT, MAX_DIGITS, MAX_LENGTH = 64, 64, 200
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression, e.g. '12*(3+4)'."""
    if len(expression) > MAX_LENGTH:
        raise ValueError(f"expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    value = _eval(tree.body)
    return str(int(value)) if isinstance(value, float) and value.is_integer() and abs(value) < 1e15 else str(value)


def _eval(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, int) and len(str(abs(value))) > MAX_DIGITS:
            raise ValueError(f"result has more than {MAX_DIGITS} digits")
        return value
    raise ValueError(f"unsupported element {type(node).__name__} (numbers and + - * / // % ** only)")


def answer_matches(prompts, responses, *, answer):
    """1.0 where the response's last number equals the row's answer, else 0.0. An answer may be
    a number or a worked solution ending "#### <number>" (GSM8K's); thousands commas are ignored."""
    out = []
    for response, want in zip(responses, answer):
        numbers = NUMBER.findall(response.replace(",", ""))
        want = str(want).rsplit("####", 1)[-1].strip().replace(",", "")
        try:
            out.append(float(bool(numbers) and float(numbers[-1]) == float(want)))
        except (TypeError, ValueError):
            out.append(0.0)
    return out


Calculator = ToolEnvironment.with_tools(calculator, reward=answer_matches)

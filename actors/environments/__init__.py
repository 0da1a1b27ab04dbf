"""Built-in environments a config names by spec, and the pieces to build tool environments.

    Calculator         actors.environments:Calculator: the calculator tool; the final answer scores 1.0
                       when its last number equals the row's ``answer`` column
    ToolEnvironment    ToolEnvironment.with_tools(fn, ..., reward=...) makes an environment whose
                       policy calls ``fn`` by name (actors/environments/tools.py)
"""
from actors.environments.calculator import Calculator, calculator
from actors.environments.tools import MalformedToolCall, ToolEnvironment

__all__ = ["Calculator", "MalformedToolCall", "ToolEnvironment", "calculator"]

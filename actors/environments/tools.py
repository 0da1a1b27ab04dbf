"""Tool use as an environment: the policy calls Python functions, reads their results, answers.

A turn that holds tool calls gets their results as the next observation; a turn without one is
the final answer, which ends the episode and is scored by the class's ``reward``. A call is
written in the tagged format of the Hermes / Qwen chat templates::

    <tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>

and, for a tool of one argument, the short form a small model can learn to write::

    <tool_call>calculator: 12*7</tool_call>

Results come back as ``<tool_response>...</tool_response>``, one per call, in order. A tool
that raises answers with its error line (the episode goes on, counted in ``info``); a call that
cannot be read (no closing tag, bad JSON, an unknown tool, arguments that do not fit its
signature, more than ``max_tool_calls`` in the episode) ends the episode as invalid.

Register functions as tools by making a class: ``MyEnv = ToolEnvironment.with_tools(fn, ...,
reward=score)``, then name it ``my_module:MyEnv`` where an environment is asked for.
"""
from __future__ import annotations

import inspect
import json
import re
from typing import Callable, Optional

from actors.environments.base import MalformedAction
from actors.rewards.scoring import ColumnBinding
from core.infra.errors import type_and_first_line

CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


class MalformedToolCall(MalformedAction):
    """A tool call that cannot be read or run as written: the episode ends invalid."""


def parse_calls(action: str, tools: dict[str, Callable]) -> list[tuple[str, dict]]:
    """The (tool name, keyword arguments) of each call in ``action``, in order."""
    calls = []
    for body, close in CALL.findall(action):
        if not close:
            raise MalformedToolCall("tool call without its closing </tool_call>")
        calls.append(_one_call(body.strip(), tools))
    return calls


def _one_call(body: str, tools: dict[str, Callable]) -> tuple[str, dict]:
    if body.startswith("{"):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            raise MalformedToolCall(f"tool call is not valid JSON ({e.msg})") from None
        if not isinstance(call, dict) or not isinstance(call.get("arguments", {}), dict):
            raise MalformedToolCall('tool call must be {"name": ..., "arguments": {...}}')
        name, kwargs = call.get("name"), call.get("arguments", {})
    else:
        name, sep, text = body.partition(":")
        name = name.strip()
        params = list(inspect.signature(tools[name]).parameters) if name in tools else []
        if not sep or len(params) != 1:
            raise MalformedToolCall(f"short tool call {body[:40]!r} needs 'name: argument' and a tool of one argument")
        kwargs = {params[0]: text.strip()}
    if name not in tools:
        raise MalformedToolCall(f"unknown tool {name!r}; tools: {', '.join(sorted(tools))}")
    try:
        inspect.signature(tools[name]).bind(**kwargs)
    except TypeError as e:
        raise MalformedToolCall(f"tool {name!r}: {e}") from None
    return name, kwargs


class ToolEnvironment:
    """An environment whose actions may call ``tools``; see the module docstring."""
    tools: dict[str, Callable] = {}
    reward: Optional[Callable] = None  # reward(prompts, responses, **columns) -> [float], as a reward function
    max_tool_calls: int = 8

    @classmethod
    def with_tools(cls, *functions: Callable, reward: Optional[Callable] = None,
                   max_tool_calls: int = 8) -> type:
        """A ToolEnvironment class calling ``functions`` (by their names) and scoring the final
        answer with ``reward`` (None: 0)."""
        names = [f.__name__ for f in functions]
        if len(set(names)) != len(names) or not all(callable(f) for f in functions):
            raise ValueError(f"ToolEnvironment.with_tools: give callables with distinct names, got {names}")
        score = None if reward is None else staticmethod(reward)
        return type(f"ToolEnvironment_{'_'.join(names)}", (cls,),
                    {"tools": dict(zip(names, functions)), "reward": score, "max_tool_calls": max_tool_calls})

    def reset(self, prompt: str, columns: dict) -> None:
        self.prompt, self.columns, self.calls, self.errors = prompt, dict(columns), 0, 0
        return None

    def step(self, action: str):
        calls = parse_calls(action, self.tools)
        if not calls:  # the final answer
            return None, self._score(action), True, {"tool_calls": self.calls, "tool_errors": self.errors}
        self.calls += len(calls)
        if self.calls > self.max_tool_calls:
            raise MalformedToolCall(f"more than {self.max_tool_calls} tool calls in one episode")
        return "".join(f"<tool_response>{self._run(name, kwargs)}</tool_response>" for name, kwargs in calls), \
            None, False, {"tool_calls": self.calls, "tool_errors": self.errors}

    def _score(self, answer: str) -> float:
        """The final answer's reward: ``reward`` called as a reward function on one pair, with
        the columns it takes (0 without one)."""
        if self.reward is None:
            return 0.0
        columns = ColumnBinding.of(self.reward).select({k: [v] for k, v in self.columns.items()})
        return float(self.reward([self.prompt], [answer], **columns)[0])

    def _run(self, name: str, kwargs: dict) -> str:
        try:
            return str(self.tools[name](**kwargs))
        except Exception as e:  # noqa: BLE001 - a tool's failure is its answer; the episode goes on
            self.errors += 1
            return f"error: {type_and_first_line(e)}"

"""Environments: what a multi-turn episode talks to between the policy's turns.

An environment is a plain Python class, named by ``"module:Class"`` as a reward function is,
and one instance serves one episode::

    class Guess:
        def reset(self, prompt: str, columns: dict) -> str | None:
            # the episode starts: the prompt's text and its row's other fields (e.g. an answer);
            # -> a first observation to show the policy before its first turn, or None
            ...

        def step(self, action: str) -> tuple[str | None, float | None, bool, dict]:
            # the policy's turn as text -> (observation, reward, done, info): the observation is
            # shown before the next turn (None: nothing), the reward is this turn's (None: none),
            # done ends the episode, info is free-form (its "tool_calls" and "tool_errors"
            # numbers at the episode's last step are counted in the metrics)
            ...

A constructor takes no arguments. What the user's code returns is checked here, so a mistake
is one line naming the class and what it returned (``InvalidStep``), and the episode that
met it ends as invalid; the run goes on. A ``step`` that cannot read the policy's action raises
``MalformedAction`` with a one-line reason: the episode ends invalid, counted as the policy's.
"""
from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Optional

from actors.rewards.scoring import load_function


class InvalidStep(ValueError):
    """An environment returned something that is not a valid reset or step result."""


class MalformedAction(InvalidStep):
    """Raised by an environment's ``step`` for an action it cannot read (e.g. a tool call that
    does not parse): the policy's fault, not the environment's. The episode ends invalid and
    is counted apart from the environment's own errors (``env/malformed_actions``)."""


@dataclass
class Step:
    """One checked ``step`` result."""
    observation: Optional[str]  # shown to the policy before its next turn; None: nothing
    reward: Optional[float]     # this turn's reward (finite); None: none this turn
    done: bool                  # the episode is over
    info: dict = field(default_factory=dict)


def check_observation(out: Any, where: str) -> Optional[str]:
    """A reset's return or a step's observation: a string or None."""
    if out is None or isinstance(out, str):
        return out
    raise InvalidStep(f"{where} returned an observation of type {type(out).__name__}; return a str or None")


def check_step(out: Any, where: str) -> Step:
    """``(observation, reward, done, info)`` as a Step; anything else raises InvalidStep."""
    if not isinstance(out, tuple) or len(out) != 4:
        shown = f"a tuple of {len(out)}" if isinstance(out, tuple) else type(out).__name__
        raise InvalidStep(f"{where} returned {shown}; return (observation, reward, done, info)")
    observation, reward, done, info = out
    observation = check_observation(observation, where)
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
            raise InvalidStep(f"{where} returned reward {reward!r}; return a finite number or None")
        reward = float(reward)
    if not isinstance(done, (bool, numbers.Integral)):
        raise InvalidStep(f"{where} returned done={done!r}; return True or False")
    if info is None:
        info = {}
    if not isinstance(info, dict):
        raise InvalidStep(f"{where} returned info of type {type(info).__name__}; return a dict")
    return Step(observation, reward, bool(done), info)


def load_environment(spec: str, key: str = "env.class") -> type:
    """Import ``"module:Class"``: a class whose instances have callable ``reset`` and ``step``.
    Any failure is a one-line ValueError naming ``key`` and the fix."""
    cls = load_function(spec, key)  # the same import rules and messages as a reward function
    if not inspect.isclass(cls):
        raise ValueError(f"{key} {spec!r} is a {type(cls).__name__}, not a class; name a class with reset() "
                         "and step()")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"{key} {spec!r}: class {cls.__name__} has no {' and no '.join(missing)} method; an "
                         "environment needs reset(prompt, columns) and step(action)")
    return cls

"""Config classes as data: ``setting(default, help)`` declares a key with its help text as field
metadata, ``@config_class`` makes a frozen dataclass whose config-typed fields default to that
class's defaults, and the choices of every Literal-typed key are checked here, for every config
alike (``choice_error``: one line naming the key and the valid values).

No torch here: a run's config is built and checked without importing the math.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Literal, Optional

from core.infra.errors import InputError

HELP = "help"  # the metadata key of a field's one-line help (--help-config, docs/config.md)


class ConfigError(InputError):
    """A user mistake in the config: the message is one line naming the key and the fix."""


def setting(default, help: str):
    """A config key: its default (immutable: a number, string, tuple or None) and its help."""
    return dataclasses.field(default=default, metadata={HELP: help})


def help_of(f: dataclasses.Field) -> str:
    """A field's help: its ``setting`` text, or a section's first docstring line ("" if none)."""
    return f.metadata.get(HELP, "")


@typing.dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field, setting))
def config_class(cls):
    """``cls`` as a frozen dataclass; a field annotated with another config class and given no
    default defaults to that class's defaults, its help being the first line of its docstring."""
    if not (cls.__doc__ or "").strip():
        raise TypeError(f"config class {cls.__name__} needs a docstring: its first line is the section's help")
    hints = typing.get_type_hints(cls)
    for name in cls.__dict__.get("__annotations__", {}):
        tp = hints[name]
        if name not in cls.__dict__ and dataclasses.is_dataclass(tp):
            doc = (tp.__doc__ or "").strip().split("\n")[0]
            setattr(cls, name, dataclasses.field(default_factory=tp, metadata={HELP: doc}))
    return dataclasses.dataclass(frozen=True)(cls)


def literal_choices(tp) -> Optional[tuple]:
    """The values of ``Literal[...]`` or ``Optional[Literal[...]]``; None for any other type."""
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    inner = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Union and len(inner) == 1:
        return literal_choices(inner[0])
    return None


def choice_error(key: str, value, choices: tuple) -> Optional[str]:
    """Why ``value`` is not a valid ``key``: one line listing the choices; None when it is one."""
    if value in choices:
        return None
    return f"{key}={value!r} is unknown; use one of {', '.join(str(c) for c in choices)}"


def check_choices(obj, prefix: str) -> None:
    """Raise ValueError for the first Literal-typed field of the dataclass ``obj`` holding a
    value outside its choices (None passes where the type is Optional)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        choices, value = literal_choices(hints[f.name]), getattr(obj, f.name)
        optional = type(None) in typing.get_args(hints[f.name])
        problem = choices and not (value is None and optional) and choice_error(f"{prefix}.{f.name}", value, choices)
        if problem:
            raise ValueError(problem)

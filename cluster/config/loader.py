"""The generic config loader: a YAML file plus dotted command-line overrides, built into a tree of
frozen config classes (core/infra/schema.py) with each value checked against its annotated type
(a Literal-typed key against its choices), and the schema walk that --help-config and
docs/config.md are made from. Every mistake is a ConfigError of one line naming the key and
the fix; an unknown key gets a "did you mean" hint. Nothing here knows a particular config.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from dataclasses import asdict, fields
from pathlib import Path
from typing import Iterator

import yaml

from core.infra.schema import ConfigError, choice_error, help_of, literal_choices


class RootConfig:
    """What a whole config (the file of one entrypoint) adds to its sections: its YAML."""

    def to_dict(self) -> dict:
        """Plain nested dict that the loader accepts back."""
        return _plain(asdict(self))

    def to_yaml(self) -> str:
        """The resolved config as YAML: the config.yaml of a run folder."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _plain(x):
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def type_name(tp) -> str:
    """How a key's type reads in messages and docs: int, Optional[str], Literal['a', 'b']."""
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _coerce(value, tp, key: str):
    """Check `value` against the annotated type `tp`; ints are accepted where floats are."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or str(origin) == "types.UnionType":
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key)
    if origin is typing.Literal:
        value = _coerce(value, type(args[0]), key)
        problem = choice_error(key, value, args)
        if problem:
            raise ConfigError(f"config: {problem}")
        return value
    if section_list(tp) is not None:  # a list of sections (reward.sources): each built as a section
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config: {key} must be a list of mappings, got {value!r}")
        return tuple(build_section(section_list(tp), item, f"{key}[{i}]") for i, item in enumerate(value))
    if tp is tuple or origin is tuple:
        if isinstance(value, str) and args and args[0] is str:  # one name where a list of names goes
            return (value,)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config: {key} must be a list, got {value!r}")
        return tuple(value)
    if origin is dict:  # a mapping of label -> value (reward.judge.choices)
        if not isinstance(value, dict):
            raise ConfigError(f"config: {key} must be a mapping like {{A: 1.0, B: 0.0}}, got {value!r}")
        return {_coerce(k, args[0], f"{key} label"): _coerce(v, args[1], f"{key}.{k}") for k, v in value.items()}
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
        return float(value)  # YAML 1.1 reads 6e-4 (no dot) as a string; it means a number here
    if tp in (int, str, bool) and isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        return value
    raise ConfigError(f"config: {key} must be {type_name(tp)}, got {value!r} "
                      f"({type(value).__name__})")


def section_list(tp):
    """The config class of ``tuple[Section, ...]`` (a key holding a list of sections); None otherwise."""
    args = typing.get_args(tp) if typing.get_origin(tp) is tuple else ()
    return args[0] if args and dataclasses.is_dataclass(args[0]) else None


def build_section(cls, data, prefix: str, root=None):
    """``cls`` from the nested dict ``data``; ``root``: the top-level class (for key hints)."""
    root = root or cls
    if not isinstance(data, dict):
        raise ConfigError(f"config: {prefix or 'the file'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise ConfigError(f"config: unknown key {full}{_unknown_key_hint(str(key), prefix, names, root)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = build_section(tp, value or {}, full, root)
        else:
            kwargs[key] = _coerce(value, tp, full)
    try:
        section = cls(**kwargs)
    except ValueError as e:  # component dataclasses validate in __post_init__
        raise ConfigError(f"config: {prefix}: {e}") from None
    if hasattr(section, "check"):  # a section whose checks name its keys by the path it is given
        try:
            section.check(prefix)
        except ValueError as e:
            raise ConfigError(f"config: {e}") from None
    return section


def walk(cls, prefix: str = "", stop: tuple = ()) -> Iterator[tuple[str, dataclasses.Field, object]]:
    """(dotted key, field, type) of every key of ``cls``, sections before their keys ("ppo.kl",
    "ppo.kl.beta"); the keys of a section whose class is in ``stop`` are left out."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        yield prefix + f.name, f, hints[f.name]
        if dataclasses.is_dataclass(hints[f.name]) and hints[f.name] not in stop:
            yield from walk(hints[f.name], f"{prefix}{f.name}.", stop)
        elif section_list(hints[f.name]) is not None:  # each item's keys, as reward.sources[].name
            yield from walk(section_list(hints[f.name]), f"{prefix}{f.name}[].", stop)


def default_of(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _unknown_key_hint(key: str, prefix: str, names: list[str], root) -> str:
    """Where the key probably belongs: the same name in another section (a key put in the
    wrong section is the commonest mistake), else a near spelling here, else anywhere."""
    paths = [path for path, _, _ in walk(root)]
    named = lambda name: [p for p in paths if p.rsplit(".", 1)[-1] == name]
    where = f" ({key} is not a {prefix} key)" if prefix else f" ({key} is not a section)"
    if named(key):
        return f"{where}; did you mean {_either(named(key))}?"
    near = difflib.get_close_matches(key, names, n=1)
    if near:
        return f"; did you mean {(prefix + '.' if prefix else '') + near[0]}?"
    near = difflib.get_close_matches(key, sorted({p.rsplit('.', 1)[-1] for p in paths}), n=1)
    if near:
        return f"{where}; did you mean {_either(named(near[0]))}?"
    return f"; valid keys: {', '.join(names)}"


def _either(paths: list[str]) -> str:
    return paths[0] if len(paths) == 1 else ", ".join(paths[:-1]) + " or " + paths[-1]


def apply_override(data: dict, override: str) -> None:
    """Set `a.b.c=value` in the nested dict; the value is parsed as YAML (0.1, true, null, [1, 2])."""
    if "=" not in override:
        raise ConfigError(f"config: override {override!r} must look like section.key=value")
    key, raw = override.split("=", 1)
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    node = data
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"config: override {key} goes through {part}, which is not a section")
    node[parts[-1]] = value


def read_config(path: str | Path | None = None, overrides: list[str] = ()) -> dict:
    """The YAML file (if any) with the dotted overrides applied, as a nested dict."""
    data = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config: file {str(p)!r} not found; pass --config path/to/file.yaml")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            problem = " ".join(str(getattr(e, "problem", None) or "").split())
            raise ConfigError(f"config: {p} is not valid YAML{where}" + (f" ({problem})" if problem else "")
                              + "; fix the YAML there") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config: {p} is not UTF-8 text; save it as UTF-8") from None
    for o in overrides:
        apply_override(data, o)
    return data


def load(cls, path: str | Path | None = None, overrides: list[str] = ()):
    """``cls`` (a RootConfig with ``validate()``) from YAML + overrides, validated once and frozen."""
    cfg = build_section(cls, read_config(path, overrides), "")
    cfg.validate()
    return cfg


def describe(root) -> str:
    """Every key of ``root`` with its default and help (and a Literal key's choices), for --help-config."""
    lines = []
    for path, f, tp in walk(root):
        if dataclasses.is_dataclass(tp):
            continue
        text, choices = help_of(f), literal_choices(tp) or ()
        if not all(str(c) in text for c in choices):  # the help names the choices, or we do
            text += f" (one of: {', '.join(map(str, choices))})"
        lines.append(f"{path} = {default_of(f)!r}" + (f"    # {text}" if text else ""))
    return "\n".join(lines)

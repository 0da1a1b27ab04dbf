"""Node labels as the configs write them: ``key=value[,key=value]``, the form of ``ray start --labels``
(a pool's ``node_labels``; cluster/runtime/pools/placement.py places by them).

Keys and values follow Ray's label syntax (Kubernetes'): a name of up to 63 characters, starting
and ending with a letter or digit, with ``-``, ``_`` and ``.`` between; a key may carry a DNS
prefix (``example.com/zone``). Values are plain: a node matches when it carries every pair.
"""
from __future__ import annotations

import re
from typing import Optional

from core.infra.schema import ConfigError

FORM = "key=value[,key=value]"
_NAME = r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?"
_PREFIX = rf"{_NAME}(\.{_NAME})*"


def parse_labels(text: Optional[str]) -> dict[str, str]:
    """``"a=1,b=2"`` -> ``{"a": "1", "b": "2"}``; None -> {}. ValueError saying what is wrong."""
    if text is None:
        return {}
    labels: dict[str, str] = {}
    for pair in text.split(","):
        key, eq, value = (part.strip() for part in pair.partition("="))
        if not eq:
            raise ValueError(f"{pair.strip()!r} has no '='")
        if not key or not value:
            raise ValueError(f"{pair.strip()!r} has an empty {'key' if not key else 'value'}")
        problem = _key_problem(key) or _value_problem(value)
        if problem:
            raise ValueError(problem)
        if key in labels:
            raise ValueError(f"{key!r} is given twice")
        labels[key] = value
    return labels


def format_labels(labels: dict[str, str]) -> str:
    """The inverse of parse_labels: ``a=1,b=2``."""
    return ",".join(f"{k}={v}" for k, v in labels.items())


def check_node_labels(key: str, text: Optional[str]) -> None:
    """ConfigError naming ``key`` when ``text`` is not ``key=value[,key=value]``."""
    try:
        parse_labels(text)
    except ValueError as e:
        raise ConfigError(f"config: {key}={text!r}: write {FORM} (as ray start --labels); {e}") from None


def _key_problem(key: str) -> Optional[str]:
    prefix, _, name = key.rpartition("/")
    if "/" in key and (len(prefix) > 253 or not re.fullmatch(_PREFIX, prefix)):
        return f"label key {key!r} has a bad prefix (DNS labels separated by dots, then '/')"
    if len(name) > 63 or not re.fullmatch(_NAME, name):
        return (f"label key {key!r}: up to 63 letters, digits, '-', '_' or '.', starting and ending "
                "with a letter or digit")
    return None


def _value_problem(value: str) -> Optional[str]:
    if len(value) > 63 or not re.fullmatch(_NAME, value):
        return (f"label value {value!r}: up to 63 letters, digits, '-', '_' or '.', starting and ending "
                "with a letter or digit")
    return None

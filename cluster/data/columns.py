"""A prompt row's other fields (data.columns): the ones kept, and rows that lack a column
the reward requires (skipped as "missing_column", cluster/data/prompts.py)."""
from __future__ import annotations

from typing import Sequence

from core.infra.errors import InputError


def select_columns(rows: list[tuple[str, dict]], field: str, columns: Sequence[str] | None,
                   source: str) -> list[tuple[str, dict]]:
    """The rows with the prompt ``field`` and the ``columns`` named (data.columns; None: every
    field). A column that no row has is a one-line ValueError listing the fields they have."""
    if columns is None:
        return rows
    if isinstance(columns, str) or not all(isinstance(c, str) for c in columns):
        raise InputError(f"data.columns must be a list of field names (or null for all), got {columns!r}")
    seen = {k for _, row in rows for k in row}
    absent = [c for c in columns if c not in seen]
    if absent:
        raise InputError(f"data.columns names {', '.join(map(repr, absent))}, which no row of {source} has "
                         f"(their fields: {', '.join(map(repr, sorted(seen)))}); remove it from data.columns "
                         "or add it to the data")
    keep = {field, *columns}
    return [(where, {k: v for k, v in row.items() if k in keep}) for where, row in rows]


def drop_missing(rows: list[tuple[str, dict]], required: set[str], skips) -> list[tuple[str, dict]]:
    """The rows that hold every required column some row has (not null); the others skipped
    and counted as "missing_column"."""
    held = {c for c in required if any(row.get(c) is not None for _, row in rows)}
    out = []
    for where, row in rows:
        lacking = sorted(c for c in held if row.get(c) is None)
        if lacking:
            skips.add("missing_column", f"{where}: no value for the column {lacking[0]!r}, which the reward "
                                        "requires")
        else:
            out.append((where, row))
    return out


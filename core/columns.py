"""The prompt rows' other fields (an answer, a source, test cases), by dataset id.

    table = PromptColumns(ids=[0, 1], rows=[{"answer": 4, "source": "gsm8k"}, {"answer": 9}])
    table.names                    # ("answer", "source")
    table.take([1, 0])             # {"answer": [9, 4], "source": [None, "gsm8k"]}

The driver builds one table from the data, puts it in Ray's object store once, and every
reward replica is handed that one reference when it starts (replacements too): a chunk's
columns are then looked up by its rollouts' prompt indices (the dataset ids) in the replica
itself, and never travel with the chunk or through the driver per step. Torch-free.
"""
from __future__ import annotations

from typing import Iterable, Sequence


class PromptColumns:
    """Each prompt's other fields, keyed by its dataset id (``PromptDataset.ids``).

    Values are whatever the data holds (any JSON type: an int answer stays an int). A row
    that lacks a field has None for it. An empty table (``names == ()``) gives no columns.
    """

    def __init__(self, ids: Sequence[int] = (), rows: Sequence[dict] = ()):
        if len(ids) != len(rows):
            raise ValueError(f"PromptColumns: {len(ids)} ids for {len(rows)} rows")
        names = list(dict.fromkeys(k for row in rows for k in row))  # first-seen order
        self._pos = {int(i): p for p, i in enumerate(ids)}
        if len(self._pos) != len(ids):
            raise ValueError("PromptColumns: ids must be distinct")
        self._values = {name: [row.get(name) for row in rows] for name in names}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._values)

    def __len__(self) -> int:
        return len(self._pos)

    def __contains__(self, prompt_index) -> bool:
        return int(prompt_index) in self._pos

    def take(self, prompt_indices: Iterable[int]) -> dict[str, list]:
        """``{name: [value per index]}``, in the order of ``prompt_indices``; ``{}`` when any
        index is not in the table (rollouts numbered by batch position, not by dataset id):
        a function that requires a column then fails loudly rather than scoring on None."""
        pos = [self._pos.get(int(i)) for i in prompt_indices]
        if not self._values or any(p is None for p in pos):
            return {}
        return {name: [values[p] for p in pos] for name, values in self._values.items()}

    def row(self, prompt_index: int) -> dict:
        """One prompt's fields (``{}`` if it is not in the table)."""
        p = self._pos.get(int(prompt_index))
        return {} if p is None else {name: values[p] for name, values in self._values.items()}

    def __repr__(self) -> str:
        return f"PromptColumns({len(self)} rows, names={list(self.names)})"

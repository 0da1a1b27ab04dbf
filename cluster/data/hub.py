"""Rows of a dataset on the Hugging Face Hub, read through `datasets.load_dataset` and its cache.

    is_hub_id("openai/gsm8k")                                         # True, unless ./openai/gsm8k exists
    rows = read_hub_rows("openai/gsm8k", split="train", config_name="main", section="data")

`datasets` keeps what it downloads in its cache (HF_DATASETS_CACHE, else HF_HOME/datasets) and
reads it from there when the Hub cannot be reached (HF_HUB_OFFLINE=1 / HF_DATASETS_OFFLINE=1, or
no network). A dataset never downloaded on this machine then cannot be read: that, an unknown
split or config, and a missing dataset are each one line naming the key to change.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

from core.infra.errors import InputError

# owner/name as the Hub spells a repository: letters, digits, '-', '_', '.'; one slash.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".txt", ".arrow")


def is_hub_id(path: str | Path) -> bool:
    """Whether ``data.path`` names a Hub dataset rather than a local file or folder.

    An existing local path always wins (``./openai/gsm8k`` shadows the Hub's). Otherwise
    ``owner/name`` (one slash, no leading ``.``, ``/`` or ``~``) is a Hub id, unless it ends
    like a data file (``data/prompts.jsonl`` is a missing file, not a dataset): a mistyped
    local path is then reported as missing, as before.
    """
    text = str(path)
    if Path(text).expanduser().exists() or not _HUB_ID.fullmatch(text):
        return False
    return not text.lower().endswith(_FILE_SUFFIXES)


def read_hub_rows(path: str, *, split: str, config_name: str | None, section: str) -> list[tuple[str, dict]]:
    """``[("row i", {column: value})]``: every row of ``split`` of the Hub dataset ``path``
    (config ``config_name``), all columns kept. Problems are one-line ValueErrors."""
    try:
        import datasets
    except ImportError:
        raise ImportError(f"{section}.path: {path!r} is read as a Hugging Face Hub dataset, which needs the "
                          "datasets package; pip install datasets (or point it at a local .jsonl)") from None
    where = f"{section}.path {path!r} (split {split!r}" + (f", config {config_name!r})" if config_name else ")")
    try:
        ds = datasets.load_dataset(path, config_name, split=split)
    except ConnectionError:  # offline or unreachable, and not in the local cache
        why = "offline" if datasets.config.HF_HUB_OFFLINE else "no network"
        raise InputError(f"{where} is not in the local datasets cache and the Hub cannot be reached ({why}); "
                         f"download it once with network access, or point {section}.path at a local file") from None
    except ValueError as e:
        raise InputError(_choice_problem(str(e), path, split, config_name, section) or
                         f"{where} cannot be read: {_first_line(e)}") from None
    except FileNotFoundError as e:  # datasets' DatasetNotFoundError / DataFilesNotFoundError
        raise InputError(f"{where}: {_first_line(e)}; check the dataset id (and log in with `hf auth login` "
                         f"for a gated one), or point {section}.path at a local file") from None
    columns = ds.to_dict()
    return [(f"row {i}", {c: values[i] for c, values in columns.items()}) for i in range(len(ds))]


def _choice_problem(message: str, path: str, split: str, config_name: str | None, section: str) -> str | None:
    """The one line for an unknown split or config (datasets' message names the choices), else None."""
    names = _listed_names(message)
    if message.startswith("Unknown split"):
        return (f"{section}.split={split!r} is not a split of {path!r}; available: {', '.join(names)}; "
                f"set {section}.split to one of them")
    if any(s in message for s in ("BuilderConfig", "Config name is missing", "configurations in the cache",
                                  "for config")):
        now = (f"{section}.config_name={config_name!r} is not a config of {path!r}" if config_name else
               f"{section}.config_name is not set and {path!r} has several configs")
        cached = " cached locally" if "cache" in message else ""
        return (f"{now}; available{cached}: {', '.join(sorted(names)) or 'none'}; "
                f"set {section}.config_name to one of them")
    return None


def _listed_names(message: str) -> list[str]:
    """The names in datasets' "... ['a', 'b']" or "... in the cache: a, b" messages."""
    bracket = re.search(r"\[[^\]]*\]", message)
    if bracket:
        try:
            return [str(n) for n in ast.literal_eval(bracket.group(0))]
        except (ValueError, SyntaxError):
            pass
    listed = re.search(r"in the cache: ([^\n]*)", message)
    return [n.strip() for n in listed.group(1).split(",")] if listed else []


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]

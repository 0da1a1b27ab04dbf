"""Prompt datasets for the PPO driver.

    ds = PromptDataset.load(path="prompts.jsonl", tokenizer_path=model_dir)   # config: data.*
    train, evaluation = ds.split_eval(32)
    for indices, prompt_ids, texts in train.batches(batch_size=16, epochs=2):
        ...

Sources: a `.jsonl` file (one JSON object per line), a `.parquet` file (needs pyarrow), a
directory written by Hugging Face `datasets` `save_to_disk` (needs datasets), a Hugging Face
Hub dataset id such as `openai/gsm8k` (its `split` and `config_name`, through `datasets`' cache:
cluster/data/hub.py), or `path=None` for the built-in prompt set (`builtin_prompts()`, sentence
starts for the sentiment demo). A prompt is a string or a chat (a list of role/content
messages, rendered by the tokenizer's chat template: cluster/data/chat.py). Bad rows never stop
a run: they are skipped and counted in `dataset.skipped` (reasons) and `dataset.skip_counts`
(per kind). A row's other fields (an answer, a source) are kept in `dataset.columns`
(core/columns.py), for the reward.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from cluster.data.chat import is_chat, message_problem, render_prompts
from cluster.data.columns import drop_missing, select_columns
from cluster.demo.sentiment import builtin_prompts
from core.columns import PromptColumns
from core.infra.errors import InputError

SUPPORTED = ".jsonl, .parquet, a directory saved with datasets.Dataset.save_to_disk, or a Hub dataset id owner/name"
MAX_REASONS = 1000  # skipped rows whose reason is kept verbatim; skip_counts stays exact


@dataclass
class PromptDataset:
    """Prompts, tokenized once.

    texts       the prompt strings as the policy sees them (chat template applied to chats, and to
                strings if asked)
    prompt_ids  one np.int64 array per prompt
    ids         np.int64 [N]: each prompt's position in the loaded dataset (after skipping);
                stable across `split_eval`, so it is what `batches` yields as indices
    skipped     reasons for skipped rows ("line 7: malformed JSON (...)"), first MAX_REASONS
    skip_counts exact count of skipped rows per kind ("malformed_json", "missing_field",
                "not_a_string", "empty", "not_an_object", "bad_messages", "too_long", "missing_column")
    columns     the rows' other fields by id (core/columns.py), for the reward: the table of
                the whole loaded set, shared by both parts of `split_eval` (ids are stable)
    """
    texts: list[str]
    prompt_ids: list[np.ndarray]
    ids: np.ndarray
    seed: int = 0
    source: str = "builtin"
    skipped: list[str] = field(default_factory=list)
    skip_counts: dict[str, int] = field(default_factory=dict)
    columns: PromptColumns = field(default_factory=PromptColumns)

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def num_skipped(self) -> int:
        return sum(self.skip_counts.values())

    @classmethod
    def load(cls, *, path: str | None, field: str = "prompt", tokenizer_path: str,
             chat_template: bool = False, max_prompt_tokens: int | None = None,
             seed: int = 0, split: str = "train", config_name: str | None = None,
             columns: Sequence[str] | None = None, required_columns: Iterable[str] = (),
             system_prompt: str | None = None) -> "PromptDataset":
        """Read, validate and tokenize a prompt set (`path=None`: `builtin_prompts()`).

        Rows without `field`, or whose value is neither a string nor a list of messages, or is
        blank, or a malformed chat ("bad_messages"), are skipped and counted, as are malformed
        JSON lines (reason names the line number) and, when `max_prompt_tokens` is set, prompts
        longer than that many tokens (dropped, not cut: a truncated prompt is a different
        question). Blank lines in .jsonl are ignored. `split` and `config_name` choose the
        part of a Hub dataset (`path` an id). Prompts are tokenized without added special
        tokens when a chat template is applied (the template carries them), with the
        tokenizer's defaults otherwise.

        `columns`: the other fields to keep (data.columns; None: all of them); naming one that
        no row has is a ValueError. A row that lacks (or has null for) one of
        `required_columns` (what the reward requires) is skipped ("missing_column"), unless no
        row has it: that is the reward's mistake, and the start-up probe names it.
        """
        from transformers import AutoTokenizer

        if max_prompt_tokens is not None and max_prompt_tokens < 1:
            raise InputError(f"data.max_prompt_tokens must be >= 1 or null, got {max_prompt_tokens}")
        rows, skips, source = _prompt_rows(path, field, split, config_name, columns, required_columns)
        texts = [(where, row[field]) for where, row in rows]
        tok = AutoTokenizer.from_pretrained(str(tokenizer_path))
        rendered, encoded = render_prompts(tok, [p for _, p in texts], chat_template=chat_template,
                                           tokenizer_path=tokenizer_path, column=field, system=system_prompt)
        kept_texts, kept_ids, kept_rows = [], [], []
        for (where, _), text, ids, (_, row) in zip(texts, rendered, encoded, rows):
            if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
                skips.add("too_long", f"{where}: {len(ids)} tokens > data.max_prompt_tokens={max_prompt_tokens}")
            elif not ids:
                skips.add("empty", f"{where}: prompt tokenizes to nothing")
            else:
                kept_texts.append(text)
                kept_ids.append(np.asarray(ids, dtype=np.int64))
                kept_rows.append({k: v for k, v in row.items() if k != field})
        if not kept_texts:
            raise InputError(_empty_message(source, field, skips))
        ids = np.arange(len(kept_texts), dtype=np.int64)
        return cls(texts=kept_texts, prompt_ids=kept_ids, ids=ids, seed=seed, source=source, skipped=skips.reasons,
                   skip_counts=dict(skips.counts), columns=PromptColumns(ids.tolist(), kept_rows))

    def batches(self, batch_size: int, epochs: int | None = 1, *, drop_last: bool = True,
                start_epoch: int = 0) -> Iterator[tuple[np.ndarray, list[np.ndarray], list[str]]]:
        """Yield `(indices np.int64 [B], prompt_ids list of [P_i], texts list[str])`.

        Each epoch visits every prompt once in an order drawn from (seed, epoch): the same
        seed gives the same stream, and consecutive epochs differ. `indices` are `ids`
        (positions in the loaded dataset). The last partial batch of an epoch is dropped
        by default, so every PPO step sees the same number of prompts (it comes back in
        another epoch's order); `drop_last=False` yields it. `epochs=None` runs forever;
        `start_epoch` resumes the stream at that epoch.
        """
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}")
        if drop_last and batch_size > len(self):
            raise InputError(f"batch size {batch_size} is larger than the {len(self)} prompts of {self.source}; "
                             f"lower the batch size or add prompts")
        if epochs is not None and epochs < 0:
            raise ValueError(f"epochs must be >= 0 or None, got {epochs}")
        epoch = start_epoch
        while epochs is None or epoch < start_epoch + epochs:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self))
            stop = len(order) - len(order) % batch_size if drop_last else len(order)
            for lo in range(0, stop, batch_size):
                take = order[lo:lo + batch_size]
                yield self.ids[take], [self.prompt_ids[i] for i in take], [self.texts[i] for i in take]
            epoch += 1

    def split_eval(self, n: int) -> tuple["PromptDataset", "PromptDataset"]:
        """`(train, evaluation)`: n prompts held out, chosen by the dataset seed.

        Deterministic for a given seed and dataset; both parts keep their original `ids`
        (disjoint) and their relative order, and inherit the seed (batches of train are
        then shuffled over its own prompts). n=0 gives an empty evaluation set.
        """
        if not 0 <= n < len(self):
            raise InputError(f"data.eval_prompts must be in [0, {len(self) - 1}] for {len(self)} prompts, got {n}")
        held = np.zeros(len(self), dtype=bool)
        held[np.random.default_rng([self.seed, 0xE7A1]).permutation(len(self))[:n]] = True
        return self._subset(np.flatnonzero(~held)), self._subset(np.flatnonzero(held))

    def _subset(self, rows: Iterable[int]) -> "PromptDataset":
        rows = list(rows)
        return PromptDataset(texts=[self.texts[i] for i in rows], prompt_ids=[self.prompt_ids[i] for i in rows],
                             ids=self.ids[rows] if rows else np.zeros(0, np.int64), seed=self.seed,
                             source=self.source, skipped=self.skipped, skip_counts=self.skip_counts,
                             columns=self.columns)


def _prompt_rows(path, field: str, split: str, config_name: str | None, columns: Sequence[str] | None,
                 required_columns: Iterable[str]) -> tuple[list[tuple[str, dict]], "Skips", str]:
    """`(rows, skips, source)` of a prompt set, each row its prompt and kept columns."""
    if path is None:
        return [(f"prompt {i}", {field: p}) for i, p in enumerate(builtin_prompts())], Skips(), "builtin"
    rows, skips = read_records(path, {"data.field": field}, "data", keep=None, chat_column=field,
                               split=split, config_name=config_name)
    rows = select_columns(rows, field, columns, str(path))
    return drop_missing(rows, set(required_columns), skips), skips, str(path)


def read_texts(path: str | Path, field: str, section: str, *, chats: bool = False, split: str = "train",
               config_name: str | None = None) -> tuple[list[tuple[str, object]], "Skips"]:
    """`([(where, text)], skips)`: the non-blank strings in column `field` of a .jsonl, .parquet,
    saved-dataset or Hub `path` (and, with `chats`, its usable chats: lists of messages).
    Unusable rows are skipped and counted; none usable is a ValueError naming `section`
    (the config section: "data", "ptx")."""
    rows, skips = read_records(path, {f"{section}.field": field}, section, chat_column=field if chats else None,
                               split=split, config_name=config_name)
    return [(where, row[field]) for where, row in rows], skips


def read_records(path: str | Path, fields: dict[str, str], section: str, *, chat_column: str | None = None,
                 split: str = "train", config_name: str | None = None,
                 keep: Sequence[str] | None = ()) -> tuple[list[tuple[str, dict]], "Skips"]:
    """`([(where, {column: text})], skips)`: rows of `path` whose every column in `fields`
    (config key -> column name, e.g. {"data.prompt_field": "prompt"}) holds a non-blank
    string, or for `chat_column` a usable chat (cluster/data/chat.py). Other rows are
    skipped and counted; none usable is a ValueError naming the key. `split` and
    `config_name`: the part of a Hub dataset to read (`path` an id, cluster/data/hub.py).
    `keep`: other columns each row keeps as they are (any JSON value); None: all of them."""
    skips = Skips()
    out = []
    columns = list(fields.values())
    read = None if keep is None else columns + [c for c in keep if c not in columns]
    for where, row in _read_rows(path, read, skips, section, split, config_name):
        if not isinstance(row, dict):
            skips.add("not_an_object", f"{where}: not a JSON object ({type(row).__name__})")
            continue
        problem = None
        for key, column in fields.items():
            if column not in row:
                problem = ("missing_field", f"{where}: missing field '{column}'")
                skips.fields_seen.update(map(str, row))
                skips.missing[key] += 1
            elif column == chat_column and is_chat(row[column]):
                if (bad := message_problem(row[column])) is not None:
                    problem = ("bad_messages", f"{where}: field '{column}' {bad}")
            elif not isinstance(row[column], str):
                problem = ("not_a_string", f"{where}: field '{column}' is {type(row[column]).__name__}, not a string")
            elif not row[column].strip():
                problem = ("empty", f"{where}: field '{column}' is empty")
            if problem:
                break
        if problem:
            skips.add(*problem)
        else:
            out.append((where, {c: v for c, v in row.items() if keep is None or c in read}))
    if not out:
        raise InputError(_empty_message(str(path), fields, skips, section))
    return out, skips


class Skips:
    def __init__(self):
        self.counts, self.reasons = Counter(), []
        self.fields_seen = Counter()  # the fields of rows that lack data.field: the likely fix
        self.missing = Counter()  # config key -> rows that lack its column

    def add(self, kind: str, reason: str) -> None:
        self.counts[kind] += 1
        if len(self.reasons) < MAX_REASONS:
            self.reasons.append(reason)


def _empty_message(source: str, fields: str | dict[str, str], skips: Skips, section: str = "data") -> str:
    """Why nothing usable was read. ``fields``: the column (key ``{section}.field``), or
    config key -> column when a row needs several."""
    if isinstance(fields, str):
        fields = {f"{section}.field": fields}
    noun = "rows" if len(fields) > 1 else "prompts" if section == "data" else "texts"
    first_key, first = next(iter(fields.items()))
    if not skips.counts:
        return f"{section}.path: {source} holds no {noun}; add rows with a '{first}' field ({first_key})"
    if set(skips.counts) == {"missing_field"}:
        n = skips.counts["missing_field"]
        key = skips.missing.most_common(1)[0][0] if skips.missing else first_key
        seen = ", ".join(f"'{k}'" for k, _ in skips.fields_seen.most_common(5)) or "none"
        fix = f"the {noun[:-1]} column" if len(fields) == 1 else "the column that holds it"
        return (f"{key}='{fields[key]}' is in none of the {n} rows of {source} (missing_field={n}; "
                f"their fields: {seen}); set {key} to {fix}")
    kinds = ", ".join(f"{k}={v}" for k, v in skips.counts.most_common())
    now = ", ".join(f"{k}='{c}'" for k, c in fields.items())
    return (f"{section}.path: no usable {noun} in {source}: all {sum(skips.counts.values())} rows skipped "
            f"({kinds}; first: {skips.reasons[0]}); check {now}")


def _read_rows(path: str | Path, fields: list[str] | None, skips: Skips, section: str, split: str,
               config_name: str | None) -> list[tuple[str, object]]:
    """`(where, row)` pairs; malformed JSON lines are recorded in `skips` and left out."""
    from cluster.data.hub import is_hub_id, read_hub_rows

    if is_hub_id(path):
        return read_hub_rows(str(path), split=split, config_name=config_name, section=section)
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{section}.path: {path} does not exist; point it at a file ({SUPPORTED})"
                                + (", or set data.path=null for the built-in prompts" if section == "data" else ""))
    if config_name is not None:
        raise InputError(f"{section}.config_name={config_name!r} names a config of a Hub dataset, but {section}.path "
                         f"{path} is local; set {section}.config_name: null")
    if path.is_dir():
        return _read_saved_dataset(path, fields, skips, section, split)
    if split != "train":  # a file is one split: a silently ignored choice would train on the wrong one
        raise InputError(f"{section}.split={split!r} chooses a split of a Hub dataset or a saved DatasetDict folder, "
                         f"but {path} is one file; point {section}.path at that split's file and leave "
                         f"{section}.split: train")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path, skips, section)
    if suffix == ".parquet":
        return _read_parquet(path, fields, skips, section)
    raise InputError(f"{section}.path: unsupported file type '{path.suffix}' for {path}; supported: {SUPPORTED}")


def _read_jsonl(path: Path, skips: Skips, section: str) -> list[tuple[str, object]]:
    rows = []
    # Split on newlines only: str.splitlines() would also cut at U+2028 etc., legal inside JSON strings.
    lines = _utf8_text(path, section).replace("\r\n", "\n").replace("\r", "\n").split("\n")
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append((f"line {lineno}", json.loads(line)))
        except json.JSONDecodeError as e:
            skips.add("malformed_json", f"line {lineno}: malformed JSON ({e.msg})")
    return rows


def _utf8_text(path: Path, section: str) -> str:
    """The file as text. The encoding is the file's, not a row's: a file in another encoding
    is refused, since skipping (or mangling) its non-ASCII rows would skew the prompts unseen."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")  # -sig: a leading byte-order mark is not part of line 1
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise InputError(f"{section}.path: {path} is not UTF-8 text (byte 0x{data[e.start]:02x} on line {line}); "
                         "re-save it as UTF-8") from None


def _read_parquet(path: Path, fields: list[str], skips: Skips, section: str) -> list[tuple[str, object]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"{section}.path: reading {path} needs pyarrow; "
                          "pip install pyarrow (or use .jsonl)") from None
    pf = pq.ParquetFile(path)
    fields = pf.schema_arrow.names if fields is None else fields  # None: every column
    present = [f for f in fields if f in pf.schema_arrow.names]  # absent ones: the row check counts them
    if len(present) < len(fields):
        skips.fields_seen.update(pf.schema_arrow.names)
    table = pf.read(columns=present) if present else None
    return _columns_to_rows(pf.metadata.num_rows, {f: table.column(f).to_pylist() for f in present})


def _columns_to_rows(n: int, columns: dict[str, list]) -> list[tuple[str, dict]]:
    return [(f"row {i}", {f: values[i] for f, values in columns.items()}) for i in range(n)]


def _read_saved_dataset(path: Path, fields: list[str], skips: Skips, section: str,
                        split: str) -> list[tuple[str, object]]:
    try:
        import datasets
    except ImportError:
        raise ImportError(f"{section}.path: {path} is a directory, read as a datasets.save_to_disk folder, which "
                          f"needs the datasets package; pip install datasets (or use .jsonl)") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise InputError(f"{section}.path: directory {path} is not a datasets.save_to_disk folder; "
                         f"supported: {SUPPORTED}") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise InputError(f"{section}.split={split!r} is not a split of {path}; available: "
                             f"{', '.join(sorted(ds))}; set {section}.split to one of them")
        ds = ds[split]
    elif split != "train":
        raise InputError(f"{section}.split={split!r} chooses a split, but {path} holds one dataset, not a "
                         f"DatasetDict; leave {section}.split: train")
    fields = ds.column_names if fields is None else fields  # None: every column
    present = [f for f in fields if f in ds.column_names]  # absent ones: the row check counts them
    if len(present) < len(fields):
        skips.fields_seen.update(ds.column_names)
    return _columns_to_rows(len(ds), {f: ds[f] for f in present})

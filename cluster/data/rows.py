"""Rows for the SFT and reward-model stages: read (cluster/data/prompts.py's readers), tokenized,
split into training and held-out rows, and cut into per-rank shards.

    SFT rows   (prompt_ids, response_ids)
    RM rows    (prompt_ids, chosen_ids, rejected_ids)

Prompts are tokenized as PPO's prompts are (cluster/data/prompts.py: the tokenizer's defaults, or
the chat template's user turn with no added special tokens), responses without special
tokens and, by default, with EOS appended, so the models learn from token sequences laid
out as the generator will produce them. Rows longer than ``data.max_seq_len`` are
skipped and counted, not cut: a truncated response teaches the policy not to stop.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cluster.data.chat import chat_prompts
from cluster.data.prompts import Skips, read_records
from cluster.demo.sentiment import builtin_rows
from core.infra.errors import InputError


@dataclass
class StageRows:
    """Tokenized rows: each a tuple of int64 arrays, the prompt first."""
    rows: list[tuple]
    source: str
    skip_counts: dict = field(default_factory=dict)
    skipped: list = field(default_factory=list)

    def split(self, n_eval: int, seed: int) -> tuple[list[tuple], list[tuple]]:
        """(training rows, held-out rows): ``n_eval`` chosen by ``seed``."""
        if not 0 < n_eval < len(self.rows):
            raise InputError(f"data.eval_examples={n_eval} must be below the {len(self.rows)} usable rows of "
                             f"{self.source}; lower it or add rows")
        held = set(np.random.default_rng([seed, 0xE7A1]).permutation(len(self.rows))[:n_eval].tolist())
        return ([r for i, r in enumerate(self.rows) if i not in held],
                [r for i, r in enumerate(self.rows) if i in held])


def load_rows(*, path, fields: dict[str, str], tokenizer, tokenizer_path, chat_template: bool,
              append_eos: bool, max_seq_len: int, builtin: str, split: str = "train",
              config_name: str | None = None) -> StageRows:
    """``fields``: config key -> column, the prompt's first (e.g. {"data.prompt_field": "prompt",
    "data.response_field": "response"}). ``path=None``: ``builtin_rows(builtin)``; a Hub id:
    its ``split`` of config ``config_name``."""
    columns = list(fields.values())
    if path is None:
        rows, skips, source = [(f"row {i}", r) for i, r in enumerate(builtin_rows(builtin))], Skips(), "builtin"
        rows = [(w, {c: r[k] for c, k in zip(columns, r)}) for w, r in rows]  # builtin names -> configured columns
    else:
        rows, skips = read_records(path, fields, "data", split=split, config_name=config_name)
        source = str(path)
    prompts = [r[columns[0]] for _, r in rows]
    if chat_template:
        prompts = chat_prompts(tokenizer, prompts, tokenizer_path)
    prompt_ids = tokenizer(prompts, add_special_tokens=not chat_template)["input_ids"]
    eos = [tokenizer.eos_token_id] if append_eos and tokenizer.eos_token_id is not None else []
    replies = [tokenizer([r[c] for _, r in rows], add_special_tokens=False)["input_ids"] for c in columns[1:]]
    kept = []
    for i, (where, _) in enumerate(rows):
        parts = [prompt_ids[i]] + [reply[i] + eos for reply in replies]
        longest = len(parts[0]) + max(len(p) for p in parts[1:])
        if longest > max_seq_len:
            skips.add("too_long", f"{where}: {longest} tokens > data.max_seq_len={max_seq_len}")
        elif min(len(p) for p in parts) == 0:
            skips.add("empty", f"{where}: a field tokenizes to nothing")
        else:
            kept.append(tuple(np.asarray(p, dtype=np.int64) for p in parts))
    if not kept:
        kinds = ", ".join(f"{k}={v}" for k, v in skips.counts.most_common())
        raise InputError(f"data.path: no usable rows in {source}: all {len(rows)} skipped ({kinds}; first: "
                         f"{skips.reasons[0]}); raise data.max_seq_len or check the data")
    return StageRows(rows=kept, source=source, skip_counts=dict(skips.counts), skipped=skips.reasons)


def epoch_shards(n: int, batch_size: int, world_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Row indices per rank for one epoch: a seeded shuffle cut into whole batches (the last
    partial batch is left out; another epoch's order brings its rows back), and within
    each batch rank r takes rows r, r+W, ...; every rank gets the same count."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    order = order[:len(order) - len(order) % batch_size]
    return [[int(i) for b in range(0, len(order), batch_size) for i in order[b + r:b + batch_size:world_size]]
            for r in range(world_size)]


def rank_shards(rows: list, world_size: int) -> list[list]:
    """Rows r, r+W, ... to rank r (evaluation and scoring: shares may differ by one)."""
    return [rows[r::world_size] for r in range(world_size)]

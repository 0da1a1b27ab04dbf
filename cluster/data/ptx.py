"""Pretraining text for the PTX loss (InstructGPT's "PPO-ptx"), packed into rows.

InstructGPT mixes the pretraining gradient into PPO to keep the policy's language
modelling from regressing: the objective maximised is

    E_(x,y)~pi [ r(x, y) - beta * log(pi(y|x) / pi_ref(y|x)) ] + gamma * E_x~D_pretrain [ log pi(x) ]

with gamma = ``ppo.ptx_coef``. Here every optimizer step of the PPO update adds
``ptx_coef`` x the token-mean next-token loss of its own slice of PTX rows.

The text comes from ``ptx.path`` (.jsonl / .parquet / a saved HF dataset / a Hub dataset id with
``ptx.split`` and ``ptx.config_name``, column ``ptx.field``); the built-in corpus stands in
only for the built-in policy, whose language it is. Documents are tokenized, each followed
by EOS, concatenated and cut into rows of ``seq_len`` tokens (the tail shorter than a row is
dropped), so no position is padding. Which rows a step trains on depends only on (seed, step), so a
resumed run mixes in what the uninterrupted one would have.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from core.infra.errors import InputError

log = logging.getLogger("tether")

BUILTIN_DOCUMENTS = 2000  # sentences of the built-in corpus (cluster.demo.sentiment.corpus)


@dataclass
class PTXData:
    rows: np.ndarray      # [N, T] int64: packed token ids, no padding
    source: str           # where the text came from (for logs)
    seed: int = 0

    @classmethod
    def load(cls, *, path: str | None, field: str, tokenizer_path: str, seq_len: int,
             builtin_policy: bool, seed: int = 0, split: str = "train",
             config_name: str | None = None) -> "PTXData":
        """Read, tokenize and pack. ``path=None`` means the built-in corpus, which is only
        the built-in policy's pretraining text: any other policy must name its own."""
        if seq_len < 2:
            raise InputError(f"ptx.seq_len={seq_len} must be >= 2 (next-token targets need two tokens)")
        if path is None:
            if not builtin_policy:
                raise InputError("ppo.ptx_coef > 0 needs pretraining text for this policy: set ptx.path to a "
                                 ".jsonl/.parquet/saved dataset with a text column (the built-in corpus is "
                                 "only the built-in model's)")
            from cluster.demo.sentiment import corpus
            texts, source = corpus(BUILTIN_DOCUMENTS), "builtin corpus"
        else:
            from cluster.data.prompts import read_texts
            found, skips = read_texts(path, field, "ptx", split=split, config_name=config_name)
            if skips.counts:
                log.warning("ptx: skipped %d rows %s, e.g. %s", sum(skips.counts.values()), dict(skips.counts),
                            skips.reasons[0])
            texts, source = [t for _, t in found], str(path)
        rows = pack(tokenize(texts, tokenizer_path), seq_len)
        if len(rows) == 0:
            raise InputError(f"ptx.path: {source} has fewer than ptx.seq_len={seq_len} tokens in all; "
                             "add text or lower ptx.seq_len")
        return cls(rows=rows, source=source, seed=seed)

    def __len__(self) -> int:
        return len(self.rows)

    def rows_for_step(self, step: int, n: int) -> np.ndarray:
        """[n, T] rows for PPO step ``step`` (0-based): consecutive slices of a permutation of
        all rows, drawn anew each pass from (seed, pass), so every row is used once per pass."""
        if n < 1:
            raise ValueError(f"PTXData.rows_for_step: n must be >= 1, got {n}")
        start = step * n
        out = []
        for pos in range(start, start + n):
            epoch, i = divmod(pos, len(self.rows))
            out.append(self._order(epoch)[i])
        return self.rows[np.asarray(out)]

    def _order(self, epoch: int) -> np.ndarray:
        cache = getattr(self, "_orders", None)
        if cache is None or cache[0] != epoch:
            self._orders = (epoch, np.random.default_rng([self.seed, epoch, 0x7E7]).permutation(len(self.rows)))
        return self._orders[1]


def tokenize(texts: list[str], tokenizer_path: str) -> list[np.ndarray]:
    """Each text's ids (no special tokens) with the tokenizer's EOS after it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_path))
    if tok.eos_token_id is None:
        raise InputError(f"ptx: the tokenizer at {tokenizer_path} has no eos_token to separate documents")
    encoded = tok(texts, add_special_tokens=False)["input_ids"]
    return [np.asarray(ids + [tok.eos_token_id], dtype=np.int64) for ids in encoded]


def pack(documents: list[np.ndarray], seq_len: int) -> np.ndarray:
    """Concatenate documents and cut into [N, seq_len] rows; a last partial row is dropped."""
    stream = np.concatenate(documents) if documents else np.zeros(0, dtype=np.int64)
    n = stream.size // seq_len
    return stream[:n * seq_len].reshape(n, seq_len)

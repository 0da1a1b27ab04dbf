"""Where a model comes from: its path checked, its tokenizer loaded, its padding id, and the
token batches every scorer takes (checked arrays, length-sorted chunks).

Shared by the actors (generator, reference, reward, judge), the learner and the start-up
checks, so each question has one answer.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Sequence

import numpy as np

log = logging.getLogger(__name__)


def resolve_model_path(model: str, role: str) -> str:
    """Fail early with a one-line error naming the path, instead of a deep HF traceback.

    Hub ids ("org/name") that do not exist locally are passed through untouched.
    """
    if model is None or str(model).strip() == "":
        raise ValueError(f"{role}: model path is empty")
    path = Path(os.path.expanduser(str(model)))
    looks_local = path.is_absolute() or str(model).startswith((".", "~")) or path.exists()
    if not looks_local and str(model).count("/") == 1:
        return str(model)
    if not path.exists():
        raise FileNotFoundError(f"{role}: model path {str(path)!r} does not exist")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ValueError(f"{role}: {str(path)!r} is not a Hugging Face model directory (no config.json)")
    return str(path)


def pad_token_id(tokenizer, config, role: str) -> int:
    """Padding positions are masked out, so any real id works; prefer pad, then eos.

    The tokenizer decides when there is one; a weights-only directory falls back to
    the model config.
    """
    source = tokenizer if tokenizer is not None else config
    if getattr(source, "pad_token_id", None) is not None:
        return int(source.pad_token_id)
    eos = getattr(source, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    if eos is not None:
        log.warning("%s: tokenizer has no pad token; falling back to eos (id %d) for padding "
                    "(masked out, so results are unaffected)", role, eos)
        return int(eos)
    log.warning("%s: tokenizer has neither pad nor eos token; padding with id 0 (masked out)", role)
    return 0


def load_tokenizer(path: str, role: str):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - any loader failure becomes one line naming the path
        raise ValueError(f"{role}: cannot load tokenizer from {path!r}: {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}") from None


def as_token_arrays(prompt_ids_batch, response_ids_batch, role: str):
    if len(prompt_ids_batch) != len(response_ids_batch):
        raise ValueError(f"{role}: {len(prompt_ids_batch)} prompts but {len(response_ids_batch)} responses")
    prompts = [np.asarray(p, dtype=np.int64).reshape(-1) for p in prompt_ids_batch]
    responses = [np.asarray(r, dtype=np.int64).reshape(-1) for r in response_ids_batch]
    return prompts, responses


def length_sorted_chunks(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Group similar lengths so each padded batch wastes little compute."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]

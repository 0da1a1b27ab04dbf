"""Reference: a frozen copy of the initial policy that scores given token sequences.

The reference model is loaded from disk by this actor alone, so it can never share
storage with a trainable policy (the KL penalty would silently shrink to zero if
the learner's updates leaked into it). Log-probs are of the distribution the generator
samples from: log_softmax(logits / T), and with top-k/top-p sampling renormalised over the
set of tokens the sampler kept at each position (the rollout's ``kept_ids``, core.sampling),
so the KL penalty compares like with like.

A replica may host the run's teacher too (``teacher``: on-policy distillation, core/distill.py):
a second frozen model scoring the same tokens under the same temperature and kept sets. A
teacher that is the reference's own model is scored once.

A forward scores a length-sorted chunk of ``batch_size`` sequences, with ``packing`` as one
row of their real tokens (core/modeling/packed_rows.py: no padding, each sequence attended alone),
else padded prompt | response (core.layout).
"""
from __future__ import annotations

import inspect
import logging
import os
import time

import numpy as np
import torch

from core.infra.dtypes import torch_dtype
from core.infra.threads import fit_threads
from core.infra.transfer import Pull, Transfer, pull_args
from core.layout import pad_prompt_response, position_ids
from core.logprobs import logprobs_from_logits
from core.modeling.architectures import load_pretrained
from core.modeling.loading import (
    as_token_arrays,
    length_sorted_chunks,
    load_tokenizer,
    pad_token_id,
    resolve_model_path,
)
from core.modeling.packed_rows import pack_sequences
from core.modeling.varlen_attention import use_varlen
from core.rollout import FrozenLogprobs
from core.sampling import check_truncation, is_truncated, pad_kept_ids

log = logging.getLogger(__name__)


class Reference:
    """Token log-probs of given (prompt, response) pairs under a frozen causal LM."""

    def __init__(self, *, model: str, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 dtype: str = "float32", batch_size: int = 16, packing: bool = True, device: str | None = None,
                 teacher: str | None = None, role: str = "Reference"):
        from transformers import AutoModelForCausalLM

        fit_threads()
        if not (temperature > 0 and np.isfinite(temperature)):
            raise ValueError(f"{role}: temperature must be a finite number > 0, got {temperature}")
        check_truncation(role, top_k, top_p)
        if batch_size < 1:
            raise ValueError(f"{role}: batch_size must be >= 1, got {batch_size}")
        self.model_path = resolve_model_path(model, role)
        self.temperature = float(temperature)
        self.top_k, self.top_p = int(top_k), float(top_p)
        self.batch_size = int(batch_size)
        self.dtype = torch_dtype(dtype, role)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        try:
            self.model = load_pretrained(AutoModelForCausalLM, self.model_path, dtype=self.dtype)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"{role}: cannot load a causal LM from {self.model_path!r}: "
                             f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
        self.model.to(self.device).eval()
        self.model.requires_grad_(False)
        try:
            tokenizer = load_tokenizer(self.model_path, role)
        except ValueError:
            tokenizer = None  # a weights-only directory is fine: we never decode
        self.pad_id = pad_token_id(tokenizer, self.model.config, role)
        # Computing the LM head only over response positions saves a [B, P, V] tensor.
        params = inspect.signature(self.model.forward).parameters
        self._logits_to_keep = "logits_to_keep" in params
        self.packing = bool(packing)
        if self.packing:  # a packed row attends per sequence where the family allows (else its mask keeps them apart)
            use_varlen(self.model)
        self._forward = self._forward_packed if self.packing else self._forward_padded
        self._counts = {"calls": 0, "sequences": 0, "tokens": 0, "seconds": 0.0}
        self.teacher = None  # the teacher's scorer; self where the teacher is the reference's model
        if teacher is not None:
            same = resolve_model_path(teacher, "Teacher") == self.model_path
            self.teacher = self if same else Reference(
                model=teacher, temperature=temperature, top_k=top_k, top_p=top_p, dtype=dtype,
                batch_size=batch_size, packing=packing, device=device, role="Teacher")

    def logprobs(self, prompt_ids_batch: list[np.ndarray], response_ids_batch: list[np.ndarray],
                 kept_ids_batch: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """Per rollout, the [R] float32 log-probs of its response tokens under the reference.

        With truncated sampling, ``kept_ids_batch`` gives each rollout's [R, K] kept set
        (Rollout.kept_ids); the reference renormalises over it."""
        prompts, responses = as_token_arrays(prompt_ids_batch, response_ids_batch, "Reference.logprobs")
        kept = self._kept_sets(kept_ids_batch, len(prompts))
        for i, p in enumerate(prompts):
            if p.size == 0:
                raise ValueError(f"Reference.logprobs: prompt {i} is empty; the first response token "
                                 "needs at least one context token")
        start = time.perf_counter()
        out: list[np.ndarray] = [np.zeros(0, dtype=np.float32) for _ in prompts]
        todo = [i for i, r in enumerate(responses) if r.size > 0]
        lengths = [prompts[i].size + responses[i].size for i in todo]
        for chunk in length_sorted_chunks(lengths, self.batch_size):
            rows = [todo[j] for j in chunk]
            lps = self._forward([prompts[i] for i in rows], [responses[i] for i in rows],
                                None if kept is None else [kept[i] for i in rows])
            for i, lp in zip(rows, lps):
                out[i] = lp
        self._counts["calls"] += 1
        self._counts["sequences"] += len(prompts)
        self._counts["tokens"] += int(sum(r.size for r in responses))
        self._counts["seconds"] += time.perf_counter() - start
        return out

    def reference_logprobs(self, rollouts: list) -> list[np.ndarray]:
        """logprobs() of Rollouts, for a caller that passes the generator's output by reference."""
        return self.logprobs([r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts],
                             [r.kept_ids for r in rollouts] if self.truncated else None)

    def reference_logprobs_pulled(self, rollouts: Pull) -> tuple[FrozenLogprobs, Transfer]:
        """reference_logprobs() of Rollouts this call pulls itself (call it with num_returns=2),
        with the teacher's where this replica hosts one, and what the pull moved between nodes
        (core/infra/transfer.py)."""
        (rollouts,), moved = pull_args(rollouts)
        reference = self.reference_logprobs(rollouts)
        if self.teacher is None:
            return FrozenLogprobs(reference), moved
        teacher = reference if self.teacher is self else self.teacher.reference_logprobs(rollouts)
        return FrozenLogprobs(reference, teacher), moved

    @property
    def truncated(self) -> bool:
        return is_truncated(self.top_k, self.top_p)

    def _kept_sets(self, kept_ids_batch, n: int):
        if not self.truncated:
            return None
        if kept_ids_batch is None or len(kept_ids_batch) != n or any(k is None for k in kept_ids_batch):
            raise ValueError(f"Reference.logprobs: sampling is truncated (top_k={self.top_k}, "
                             f"top_p={self.top_p}), so every rollout must carry the sampler's kept set "
                             "(kept_ids); a generator with the same sampling settings records it")
        return [np.asarray(k, dtype=np.int64) for k in kept_ids_batch]

    @torch.inference_mode()
    def _forward_packed(self, prompts: list[np.ndarray], responses: list[np.ndarray],
                        kept: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """The chunk's sequences as one packed row (core/modeling/packed_rows.py): no padding at all."""
        row = pack_sequences([np.concatenate([p, r]) for p, r in zip(prompts, responses)], self.device)
        at = row.predicting([p.size for p in prompts])  # [N] columns predicting the response tokens
        if self._logits_to_keep:
            logits = self.model(**row.inputs(self.model), use_cache=False, logits_to_keep=at).logits  # [1, N, V]
        else:
            logits = self.model(**row.inputs(self.model), use_cache=False).logits[:, at]
        kept_t = None
        if kept is not None:  # [B, R, K] -> [1, N, K]: each response token's kept set, in packed order
            rows = np.repeat(np.arange(len(responses)), [r.size for r in responses])
            cols = np.concatenate([np.arange(r.size) for r in responses])
            kept_t = torch.from_numpy(pad_kept_ids(kept)[rows, cols][None]).to(self.device)
        lp = logprobs_from_logits(logits.float(), row.input_ids[:, at + 1], self.temperature, kept_ids=kept_t)
        lp = lp[0].cpu().numpy().astype(np.float32)
        return [part.copy() for part in np.split(lp, np.cumsum([r.size for r in responses])[:-1])]

    @torch.inference_mode()
    def _forward_padded(self, prompts: list[np.ndarray], responses: list[np.ndarray],
                        kept: list[np.ndarray] | None = None) -> list[np.ndarray]:
        # Every response starts at column P (core.layout), so one slice of the logits serves the batch.
        P = max(p.size for p in prompts)
        R = max(r.size for r in responses)
        ids, mask = pad_prompt_response(prompts, responses, self.pad_id)
        ids_t = torch.from_numpy(ids).to(self.device)
        mask_t = torch.from_numpy(mask).to(self.device)
        kwargs = {"input_ids": ids_t, "attention_mask": mask_t, "position_ids": position_ids(mask_t),
                  "use_cache": False}
        if self._logits_to_keep:
            logits = self.model(**kwargs, logits_to_keep=R + 1).logits[:, :R]
        else:
            logits = self.model(**kwargs).logits[:, P - 1:P + R - 1]
        kept_t = None if kept is None else torch.from_numpy(pad_kept_ids(kept)).to(self.device)
        lp = logprobs_from_logits(logits.float(), ids_t[:, P:], self.temperature, kept_ids=kept_t)
        lp = lp.cpu().numpy().astype(np.float32)
        return [lp[row, :r.size].copy() for row, r in enumerate(responses)]

    def health(self) -> dict:
        return {"role": "reference", "ok": True, "pid": os.getpid(), "model": self.model_path,
                "device": str(self.device),
                "dtype": str(self.dtype).replace("torch.", ""), "packing": self.packing,
                "temperature": self.temperature,
                "top_k": self.top_k, "top_p": self.top_p,
                **self._rounded_counts(),
                **({} if self.teacher is None else {"teacher": {"model": self.teacher.model_path,
                                                                **self.teacher._rounded_counts()}})}

    def _rounded_counts(self) -> dict:
        """calls, sequences, tokens and seconds scored so far (a teacher that is the reference's
        model: the reference's, since one forward serves both)."""
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in self._counts.items()}

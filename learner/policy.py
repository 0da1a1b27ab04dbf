"""Policy with a value head, saved and loaded in Hugging Face format.

Shared critic (default): the value head reads the policy's own last hidden state,
so one forward gives logits and values. Separate critic: the value head reads a
second body, taken from a sequence-classification checkpoint (normally the reward
model), behind the same interface. No critic (the critic-free estimators): no value
head, values read 0. Either way the whole thing is one nn.Module, so one DeepSpeed
engine trains it with one optimiser.

On disk: the LM is a plain HF checkpoint (AutoModelForCausalLM loads it
unchanged, which is what vLLM needs), with ``value_head.safetensors`` beside it
(unless there is no critic) and, for a separate critic, the critic body under ``critic/``.
With ``learner.lora`` the LM trains as an adapter on its frozen base, and with ``lora.critic``
a separate critic's body too (learner/lora.py); the value head always trains whole.
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from core.infra.dtypes import torch_dtype
from core.logprobs import entropy_from_logits, logprobs_from_logits
from core.modeling.architectures import load_pretrained
from core.modeling.varlen_attention import boundaries, use_varlen
from learner import lora as adapters
from learner.batch import Batch
from learner.lora_config import LoraConfig
from learner.packing import PackedResponses, PaddedResponses

log = logging.getLogger(__name__)

VALUE_HEAD_FILE = "value_head.safetensors"
CRITIC_DIR = "critic"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "chat_template.jinja")


def body_of(model: nn.Module) -> nn.Module:
    """The transformer body of an HF task model (``model.model`` for Qwen2/Llama)."""
    return getattr(model, model.base_model_prefix)


def disable_dropout(model: nn.Module) -> None:
    """PPO ratios assume the learner scores tokens like the sampler did: no dropout noise."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for attr in ("attention_dropout", "dropout", "hidden_dropout"):
            if isinstance(getattr(module, attr, None), float):
                setattr(module, attr, 0.0)


def copy_tokenizer(source: Optional[str], out: Path) -> None:
    """vLLM and the reference load a checkpoint directory as a model: keep the tokenizer with it."""
    if not source:
        return
    for name in TOKENIZER_FILES:
        src = Path(source) / name
        if src.is_file() and not (out / name).exists():
            shutil.copy2(src, out / name)


def _token_outputs(logits, tokens, temperature, top_k, top_p, kept_ids, with_entropy, with_own_set) -> tuple:
    """(logprobs, entropy or None[, own-set logprobs]) of ``tokens`` [b, n] under ``logits``
    [b, n, V] (``kept_ids`` [b, n, K] or None): policy.forward's per-token outputs."""
    truncation = dict(top_k=top_k, top_p=top_p, kept_ids=kept_ids)
    logprobs = logprobs_from_logits(logits, tokens, temperature, **truncation)
    entropy = entropy_from_logits(logits, temperature, tokens=tokens, **truncation) if with_entropy else None
    if not with_own_set:
        return logprobs, entropy
    # Without the sampler's sets, logprobs are of the own set already.
    own = logprobs if kept_ids is None else logprobs_from_logits(logits, tokens, temperature, top_k=top_k, top_p=top_p)
    return logprobs, entropy, own


class HFWrapper(nn.Module):
    """What the policy and the reward model share: ``config`` is the wrapped HF model's (the
    attribute named by ``wrapped``); ``source_path`` is the checkpoint it was loaded from, whose
    tokenizer a save copies. A subclass calls ``disable_dropout(self)`` once its modules are set."""

    wrapped = "model"

    def __init__(self) -> None:
        super().__init__()
        self.source_path: Optional[str] = None

    @property
    def config(self):
        return getattr(self, self.wrapped).config

    def state_part(self, prefix: str, state_dict: Optional[dict] = None) -> dict:
        """The CPU tensors of ``state_dict`` (default: this module's) under ``prefix``, named without it."""
        sd = state_dict if state_dict is not None else self.state_dict()
        return {k[len(prefix):]: v.detach().cpu().contiguous() for k, v in sd.items() if k.startswith(prefix)}


class PolicyWithValueHead(HFWrapper):
    """HF causal LM + ``value_head`` (Linear(hidden, 1)) on the shared or a separate body."""

    wrapped = "lm"

    def __init__(self, lm: nn.Module, value_head: Optional[nn.Linear] = None,
                 critic_body: Optional[nn.Module] = None, *, with_values: bool = True) -> None:
        super().__init__()
        self.lm = lm
        self.critic_body = critic_body
        hidden = (critic_body if critic_body is not None else lm).config.hidden_size
        if value_head is None and with_values:
            # Zero init: V = 0 at the start (the GAE boundary value), identical on every rank.
            value_head = nn.Linear(hidden, 1)
            nn.init.zeros_(value_head.weight)
            nn.init.zeros_(value_head.bias)
        self.value_head = value_head  # None: no critic (the critic-free estimators); values are 0
        self.lora: Optional[LoraConfig] = None  # set when the LM carries a LoRA adapter (learner/lora.py)
        self.critic_lora: Optional[LoraConfig] = None  # set when the critic body carries one too
        self.critic_source: Optional[str] = None  # the checkpoint the critic body was loaded from
        disable_dropout(self)

    def use_varlen(self) -> dict:
        """Packed rows attend per sequence (core/modeling/varlen_attention.py) in the LM and a critic
        body, where their families allow; -> the attention each runs packed rows with."""
        bodies = {"lm": self.lm, "critic": self.critic_body}
        return {name: use_varlen(body) for name, body in bodies.items() if body is not None}

    def _hidden(self, body: nn.Module, input_ids, attention_mask, position_ids, cu_seq_lens=None) -> torch.Tensor:
        out = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False, **boundaries(body, cu_seq_lens))
        return out.last_hidden_state

    def _lm(self, input_ids, attention_mask, position_ids, keep=0, cu_seq_lens=None):
        """(logits of the last ``keep`` positions, all when 0, or of the positions in a 1-D index
        tensor ``keep``; the body's last hidden state [B, T, H]).

        The LM's own forward makes the logits, so whatever a family does after its head
        (Gemma's final soft-capping, a logit scale) is done as vLLM does it, with no per-family
        code here; a hook on the body keeps its last hidden state for the value head.
        ``cu_seq_lens``: a packed row's sequence offsets (core/modeling/varlen_attention.py).
        """
        seen = []
        hook = body_of(self.lm).register_forward_hook(lambda _module, _args, out: seen.append(out[0]))
        try:
            out = self.lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False, logits_to_keep=keep, **boundaries(self.lm, cu_seq_lens))
        finally:
            hook.remove()
        return out.logits, seen[-1]

    def _values(self, policy_hidden, input_ids, attention_mask, position_ids, cols=None, cu_seq_lens=None):
        if self.value_head is None:  # no critic: zeros, no parameters, nothing to train
            return policy_hidden.new_zeros(policy_hidden.shape[:2], dtype=torch.float32)
        if self.critic_body is None:
            hidden = policy_hidden
        else:
            hidden = self._hidden(self.critic_body, input_ids, attention_mask, position_ids, cu_seq_lens)
            hidden = hidden if cols is None else cols(hidden)
        # The head computes in fp32 whatever the weights' dtype: a bf16 matmul would round the
        # values (and so the value loss and GAE) to bf16's 3 significant digits.
        head = self.value_head
        bias = None if head.bias is None else head.bias.float()
        return nn.functional.linear(hidden.float(), head.weight.float(), bias).squeeze(-1)

    def forward(self, input_ids, attention_mask, position_ids, *, prompt_len: Optional[int] = None,
                packed: Optional[PackedResponses] = None, temperature: float = 1.0, top_k: int = 0,
                top_p: float = 1.0, kept_ids=None, with_entropy: bool = True, values_only: bool = False,
                with_own_set: bool = False):
        """Without ``prompt_len`` or ``packed``: (logits [B, T, V], values [B, T] float32) at every position.

        With ``prompt_len`` = P (the batch layout of learner.batch): (logprobs, values,
        entropy), each [B, R] for the response tokens input_ids[:, P:]. With ``packed``
        (learner/packing.py): input_ids and position_ids are one packed row [1, T],
        attention_mask is None, and the outputs are the same [B, R] of the batch it was packed
        from (zeros where it has no token). Either way the LM head runs where a logit predicts
        a response token only (``logits_to_keep``). Log-probs and entropy are of the sampled
        distribution: logits / temperature, renormalised over the sampler's kept sets
        ``kept_ids`` [B, R, K] when given, else truncated by top_k/top_p as these weights would
        sample (core.sampling). ``values_only``: (None, values, None); a separate critic then
        runs without the policy body. ``with_own_set``: a 4th output, the log-probs under the
        set these weights would keep themselves (-inf outside it: the off-policy weight's
        proximal policy). One entry point, so DeepSpeed's engine wraps every forward.
        """
        inputs = (input_ids, attention_mask, position_ids)
        if prompt_len is None and packed is None:
            logits, hidden = self._lm(*inputs)
            return logits, self._values(hidden, *inputs)
        where = packed if packed is not None else PaddedResponses(input_ids, prompt_len)
        cu = None if packed is None else packed.cu_seq_lens
        if values_only and self.critic_body is not None:
            return None, where.scatter(self._values(None, *inputs, where.hidden, cu)), None
        if values_only:
            hidden = where.hidden(self._hidden(body_of(self.lm), *inputs, cu))
            return None, where.scatter(self._values(hidden, *inputs, where.hidden, cu)), None
        logits, hidden = self._lm(*inputs, keep=where.keep, cu_seq_lens=cu)
        logits, hidden = where.logits(logits), where.hidden(hidden)
        outs = _token_outputs(logits, where.tokens, temperature, top_k, top_p, where.select(kept_ids),
                              with_entropy, with_own_set)
        values = self._values(hidden, *inputs, where.hidden, cu)
        return tuple(where.scatter(t) for t in (outs[0], values, *outs[1:]))

    def response_logprobs_values(self, batch: Batch, temperature: float = 1.0, with_entropy: bool = True,
                                 *, top_k: int = 0, top_p: float = 1.0):
        """-> (logprobs, values, entropy), each [B, R] float32, aligned with the response tokens.

        values[:, t] is the value of the state before response token t (read at the
        position that predicts it). entropy is None when ``with_entropy`` is False. With
        truncated sampling the batch's kept sets (``kept_ids``) are the renormalising sets.
        """
        return self(batch.input_ids, batch.attention_mask, batch.position_ids, prompt_len=batch.prompt_len,
                    temperature=temperature, top_k=top_k, top_p=top_p, kept_ids=batch.kept_ids,
                    with_entropy=with_entropy)

    # ------------------------------------------------------------------ persistence

    def save_pretrained(self, out_dir, state_dict: Optional[dict] = None, *, with_lm: bool = True) -> Path:
        """Write the HF LM, the value head and (separate critic) the critic body. With a LoRA
        adapter the LM is written merged (in fp32, then the base's dtype) and the adapter alone
        under ``adapter/`` in PEFT's format; an adapted critic body likewise, under ``critic/``
        and ``critic/adapter/``. ``with_lm=False`` leaves the merged models out (a resumable
        checkpoint keeps the adapters only).

        ``state_dict``: full tensors of this module (names as in ``state_dict()``); the
        learner passes one gathered from ZeRO-3 partitions, where local params are empty.
        """
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        sd = state_dict if state_dict is not None else self.state_dict()
        part = lambda prefix: self.state_part(prefix, sd)  # noqa: E731
        lm_state = part("lm.")
        if self.lora is not None:
            adapters.write_adapter(adapters.adapter_files(adapters.adapter_state(lm_state.items()), self.lora,
                                                          self.source_path), out / adapters.ADAPTER_DIR)
            lm_state = adapters.merged_state(lm_state, self.lm) if with_lm else None
        if lm_state is not None:
            self.lm.save_pretrained(out, state_dict=lm_state, safe_serialization=True)
        if self.value_head is not None:
            save_file(part("value_head."), str(out / VALUE_HEAD_FILE))
        if self.critic_body is not None:
            self._save_critic(out / CRITIC_DIR, part("critic_body."), with_body=with_lm)
        self._copy_tokenizer(out)
        return out

    def _save_critic(self, out: Path, state: dict, *, with_body: bool) -> None:
        """The critic body in HF format (AutoModel loads it); with an adapter, the body merged and
        the adapter alone under ``adapter/`` (PEFT's FEATURE_EXTRACTION task: PeftModel loads it on
        an AutoModel of ``critic_source``); ``with_body=False``: the adapter only."""
        if self.critic_lora is not None:
            files = adapters.adapter_files(adapters.adapter_state(state.items()), self.critic_lora,
                                           self.critic_source, task="FEATURE_EXTRACTION")
            adapters.write_adapter(files, out / adapters.ADAPTER_DIR)
            if not with_body:
                return
            state = adapters.merged_state(state, self.critic_body)
        self.critic_body.save_pretrained(out, state_dict=state, safe_serialization=True)

    def _copy_tokenizer(self, out: Path) -> None:
        copy_tokenizer(self.source_path, out)

    @classmethod
    def from_pretrained(cls, path, *, critic: str = "shared", critic_model: Optional[str] = None,
                        dtype: str = "float32", lora: Optional[LoraConfig] = None) -> "PolicyWithValueHead":
        """Load the LM from ``path``; the value head from ``value_head.safetensors`` if present.

        Without a saved head: zero init (shared), or the reward model's score head
        (separate critic), the usual RLHF critic initialisation. ``critic="none"``: no value
        head at all (a saved one is left unread). ``lora`` (enabled): a fresh adapter on the LM,
        whose base weights are then frozen (the value head still trains, and a critic body: in
        full, or, with ``lora.critic``, as an adapter of its own on its frozen body).
        """
        from transformers import AutoModelForCausalLM

        path = Path(path)
        dtype = torch_dtype(dtype, "learner")
        lm = load_pretrained(AutoModelForCausalLM, path, dtype=dtype)
        critic_body, head, critic_source = None, None, None
        if critic == "separate":
            critic_body, head, critic_source = _load_critic(path, critic_model, dtype)
        elif critic not in ("shared", "none"):
            raise ValueError(f"PolicyWithValueHead: critic={critic!r} must be 'shared', 'separate' or 'none'")
        model = cls(lm, head, critic_body, with_values=critic != "none")
        saved = path / VALUE_HEAD_FILE
        if saved.is_file() and model.value_head is not None:
            from safetensors.torch import load_file
            model.value_head.load_state_dict(load_file(str(saved)))
        if lora is not None and lora.enabled:
            adapters.add_adapter(lm, lora)
            model.lora = lora
            if lora.critic and critic_body is not None:
                adapters.check_base(critic_body.config, "learner.critic_model")
                adapters.add_adapter(critic_body, lora)
                model.critic_lora = lora
        model.to(dtype)
        model.source_path, model.critic_source = str(path), critic_source
        return model


def _load_critic(path: Path, critic_model: Optional[str], dtype):
    """A saved critic body (``path/critic``) or the body + score head of a reward model; -> (body,
    head or None, the checkpoint the body came from)."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    saved = path / CRITIC_DIR
    if saved.is_dir():
        return load_pretrained(AutoModel, saved, dtype=dtype), None, str(saved)
    if not critic_model:
        raise ValueError("PolicyWithValueHead: critic='separate' needs critic_model "
                         "(a sequence-classification checkpoint, e.g. the reward model)")
    seq = load_pretrained(AutoModelForSequenceClassification, critic_model, dtype=dtype)
    body = body_of(seq)
    head = nn.Linear(body.config.hidden_size, 1)
    nn.init.zeros_(head.bias)
    score = getattr(seq, "score", None)
    with torch.no_grad():
        if isinstance(score, nn.Linear) and score.out_features == 1:
            head.weight.copy_(score.weight)
        else:
            nn.init.zeros_(head.weight)
    return body, head, str(critic_model)

"""LoRA adapters on the learner's policy (and a separate critic's body), through PEFT's low-level API.

The adapter layers are injected into the Hugging Face model in place (``inject_adapter_in_model``),
not wrapped in a ``PeftModel``: the policy keeps its HF module tree, so the value head, the
saving code and every family's forward stay as they are, and only the adapter's parameters
require gradients (the optimizer holds their state alone). ``B`` starts at zero, so version 0 of
the policy is the base model exactly.

What leaves the learner is the adapter in PEFT's own format (``adapter_config.json`` and
``adapter_model.safetensors`` with ``base_model.model.`` names): the generators load it as a
vLLM LoRA adapter, and transformers and vLLM load the exported one.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterable, Optional

import torch
from torch import nn

from core.infra.errors import UserError
from learner.lora_config import LoraConfig

ADAPTER_DIR = "adapter"  # beside a saved policy: the adapter alone, in PEFT's format
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # what PeftModel.save_pretrained puts before the HF names


def peft_config(lora: LoraConfig, *, task: str = "CAUSAL_LM", exclude: tuple = ()):
    """PEFT's LoraConfig for ``lora``; ``task``: PEFT's task type (exported adapters load with
    PeftModel as that task); ``exclude``: modules never adapted (a reward model's score head)."""
    from peft import LoraConfig as PeftLoraConfig

    targets = (lora.target_modules,) if isinstance(lora.target_modules, str) else tuple(lora.target_modules)
    return PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, task_type=task,
                          target_modules="all-linear" if targets == ("all-linear",) else list(targets),
                          exclude_modules=list(exclude) or None, bias="none",
                          init_lora_weights=True if lora.init == "default" else "gaussian")


def check_base(model_config, key: str = "model.policy") -> None:
    """A quantized base cannot take tether's adapters: its weights are not the ones the
    generators serve under the adapter, nor ones DeepSpeed can hold frozen."""
    quant = getattr(model_config, "quantization_config", None)
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else getattr(quant, "quant_method", "?")
        raise UserError(f"{key} is quantized ({method}); learner.lora trains adapters on a bf16 or fp32 base: use "
                        "the unquantized checkpoint, or set learner.lora.rank=0")


def add_adapter(lm: nn.Module, lora: LoraConfig, key: str = "learner.lora.target_modules", *,
                exclude: tuple = ()) -> nn.Module:
    """Inject ``lora``'s adapter into ``lm`` in place and freeze everything else in it (but the
    ``exclude``d modules, which get no adapter: the caller trains them whole or not at all).

    Raises UserError when the target modules match no module of the model."""
    from peft import inject_adapter_in_model

    check_base(lm.config)
    try:
        inject_adapter_in_model(peft_config(lora, exclude=exclude), lm)
    except ValueError as e:  # PEFT's NoMatchingPeftModuleError is a ValueError
        if "not found in the base model" not in str(e):
            raise
        names = sorted({n.rsplit(".", 1)[-1] for n, m in lm.named_modules() if isinstance(m, nn.Linear)})
        raise UserError(f"{key}={list(lora.target_modules)} matches no module of {type(lm).__name__}; its linear "
                        f"layers are {names} (or use all-linear)") from None
    return lm


def check_targets(model_config, lora: LoraConfig, *, key: str = "model.policy", auto_class=None) -> int:
    """The adapter modules ``lora`` puts on a model of ``model_config`` (built by ``auto_class``,
    default AutoModelForCausalLM; a separate critic's body: AutoModel), found on an empty (meta)
    copy of it: a quantized base (``key`` names it), or targets that match nothing, raise
    UserError before any actor starts. Returns the number of adapted modules."""
    from transformers import AutoModelForCausalLM

    check_base(model_config, key)
    with torch.device("meta"):
        model = (auto_class or AutoModelForCausalLM).from_config(model_config)
    layers = adapter_layers(add_adapter(model, lora))
    # vLLM serves adapters on the decoder's linear layers; one on the vocabulary's layers would
    # be refused by every generator at the first push, so refuse it here, before anything starts.
    vocab = {id(m) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None}
    named = [name for name, m in model.named_modules() if id(m) in vocab and m in layers]
    if named:
        raise UserError(f"learner.lora.target_modules adapts {', '.join(sorted(set(named)))}: the generators' "
                        "engine serves adapters on the decoder's linear layers only; leave the embeddings "
                        "and the output head out (all-linear does)")
    return len(layers)


def adapter_layers(module: nn.Module) -> list:
    """The PEFT adapter layers inside ``module``."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in module.modules() if isinstance(m, BaseTunerLayer)]


@contextlib.contextmanager
def adapter_disabled(module: nn.Module):
    """The base model's forward: every adapter of ``module`` switched off inside the block."""
    layers = adapter_layers(module)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


@contextlib.contextmanager
def frozen_state_left_out(module: nn.Module):
    """``module.state_dict()`` without its frozen parameters inside the block, under every name
    one goes by: DeepSpeed's ``exclude_frozen_parameters`` drops the names ``named_parameters``
    yields, which lists a tied weight once, so a tied output head (``lm_head.weight``, the size
    of the embeddings) stayed in every LoRA checkpoint."""
    frozen = {n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}

    def drop(_module, state, prefix, _metadata):
        for name in frozen:
            state.pop(prefix + name, None)

    handle = module.register_state_dict_post_hook(drop)
    try:
        yield
    finally:
        handle.remove()


def is_adapter_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_state(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """PEFT's saved names and CPU tensors of the adapter among ``named`` (the LM's parameters,
    full tensors: gathered under ZeRO-3): ``base_model.model.<module>.lora_A.weight``."""
    state = {n: t.detach().to("cpu").contiguous() for n, t in named if is_adapter_param(n)}
    return {PEFT_PREFIX + n: t for n, t in _strip_adapter_name(state).items()}


def _strip_adapter_name(state: dict) -> dict:
    """``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight``: PEFT's saved names carry
    no adapter name (the in-model ones do: ``default``, the only adapter tether injects)."""
    return {n.replace(".default.", "."): t for n, t in state.items()}


def adapter_files(state: dict[str, torch.Tensor], lora: LoraConfig, base: Optional[str], *,
                  task: str = "CAUSAL_LM") -> dict[str, bytes]:
    """The adapter as the bytes of PEFT's two files: {file name: bytes}. A reward model's
    (``task="SEQ_CLS"``) carries its whole score head too, as PEFT's modules_to_save."""
    from safetensors.torch import save

    extra = sorted({n[len(PEFT_PREFIX):].split(".")[0] for n in state if not is_adapter_param(n)})
    config = peft_config(lora, task=task, exclude=tuple(extra)).to_dict()
    config["modules_to_save"] = extra or None
    config["base_model_name_or_path"] = base
    # PEFT's "all-linear" names are resolved per model when it injects; vLLM and PeftModel read the
    # list, so the saved config names the modules that got an adapter.
    config["target_modules"] = sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n in state if is_adapter_param(n)})
    config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
    return {CONFIG_FILE: json.dumps(config, indent=2, sort_keys=True, default=str).encode(),
            WEIGHTS_FILE: save(state, metadata={"format": "pt"})}


def write_adapter(files: dict[str, bytes], out_dir) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, blob in files.items():
        (out / name).write_bytes(blob)
    return out


def merged_state(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state of ``model`` (the LM, a critic body or a reward model's classifier: the module
    that holds the adapter layers) with each adapter folded into its base weight, in fp32 (one
    rounding to the base's dtype at the end, not one per step). ``state``: its full tensors under the
    in-model names (``q_proj.base_layer.weight``, ``q_proj.lora_A.default.weight``), gathered under
    ZeRO-3.

    The delta is PEFT's own (``get_delta_weight``): scaling x B A, transposed for a layer that keeps
    its weight as (in, out) (``fan_in_fan_out``: GPT-2's Conv1D). Each layer's settings are read
    from ``model``, its tensors from ``state``: under ZeRO-3 the module's own are partitions."""
    from peft.utils.other import transpose

    out = {}
    for name, tensor in state.items():
        if is_adapter_param(name):
            continue
        module, _, leaf = name.rpartition(".base_layer.")
        if not module:
            out[name] = tensor
            continue
        if leaf == "weight":
            layer = model.get_submodule(module)
            a, b = state[f"{module}.lora_A.default.weight"], state[f"{module}.lora_B.default.weight"]
            delta = transpose(b.float() @ a.float(), layer.fan_in_fan_out) * layer.scaling["default"]
            tensor = (tensor.float() + delta).to(tensor.dtype)
        out[f"{module}.{leaf}"] = tensor
    return out


def parameter_counts(module: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters; under ZeRO-3 a parameter's full size is its ``ds_numel``."""
    numel = lambda p: int(getattr(p, "ds_numel", p.numel()))  # noqa: E731
    params = list(module.parameters())
    return sum(numel(p) for p in params if p.requires_grad), sum(numel(p) for p in params)


def is_adapter_dir(path) -> bool:
    """A PEFT adapter folder (adapter_config.json, no model of its own): e.g. an SFT stage's adapter/."""
    path = Path(path)
    return (path / CONFIG_FILE).is_file() and not (path / "config.json").is_file()


def merge_adapter_dir(adapter_dir, out_dir) -> Path:
    """Write the base model of the PEFT adapter at ``adapter_dir`` with the adapter merged into it
    (PEFT's own merge, in fp32, then the base's dtype) to ``out_dir``, its tokenizer beside it."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = json.loads((Path(adapter_dir) / CONFIG_FILE).read_text())
    base = config.get("base_model_name_or_path")
    if not base or not Path(base).exists():
        raise UserError(f"the adapter at {adapter_dir} names its base model {base!r}, which is not here; point "
                        "model.policy at the merged model (the checkpoint folder beside adapter/) instead")
    dtype = getattr(AutoConfig.from_pretrained(base), "dtype", None) or torch.float32
    lm = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(lm, str(adapter_dir)).merge_and_unload()
    merged.to(dtype).save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(base).save_pretrained(out_dir)
    return Path(out_dir)

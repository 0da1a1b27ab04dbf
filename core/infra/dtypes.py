"""Names of the floating-point dtypes an inference model may load in (the learner's own are
core.choices.TrainableDType), the torch dtype of a name, and what ``model.dtype: auto`` means
on a device."""
from __future__ import annotations

import functools
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")  # inference (reference, reward, vLLM) accepts any

# CPU flags (as /proc/cpuinfo spells them) under which a bf16 matmul runs natively; without
# them torch converts to fp32 and back, slower than fp32 itself.
BF16_CPU_FLAGS = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX512-BF16"}


def torch_dtype(name, role: str):
    """The torch dtype named ``name`` (a torch.dtype passes through); one-line error otherwise."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"{role}: dtype {name!r} is not one of {list(DTYPES)}")
    return getattr(torch, name)


@functools.lru_cache(maxsize=1)
def _local_cpuinfo() -> str:
    """This machine's /proc/cpuinfo, read once (the config asks on every checkpoint)."""
    path = Path("/proc/cpuinfo")
    return path.read_text() if path.exists() else ""


def cpu_bf16_flags(cpuinfo: str | None = None) -> list[str]:
    """The native-bf16 instruction sets this CPU reports (AMX-BF16, AVX512-BF16), from
    /proc/cpuinfo's flags; [] where it reports none or the file is absent (not Linux)."""
    if cpuinfo is None:
        cpuinfo = _local_cpuinfo()
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return [name for flag, name in BF16_CPU_FLAGS.items() if flag in flags]


def resolve_precision(setting: str, *, on_gpu: bool, cpuinfo: str | None = None) -> tuple[str, str]:
    """(dtype, why) for a role whose precision setting is ``setting`` and that runs on a GPU
    (``on_gpu``) or a CPU like this one. ``auto`` is bfloat16 where bf16 matmuls run natively
    (a GPU, which tether assumes is Ampere or newer; a CPU with AMX-BF16 or AVX512-BF16),
    float32 elsewhere."""
    if setting != "auto":
        return setting, "set"
    if on_gpu:
        return "bfloat16", "GPU"
    flags = cpu_bf16_flags(cpuinfo)
    if flags:
        return "bfloat16", "CPU has " + " and ".join(flags)
    return "float32", "CPU has no native bf16 (neither AMX-BF16 nor AVX512-BF16)"

"""Names of the floating-point dtypes a config may ask for, declared once for every component."""
from __future__ import annotations

DTYPES = ("float32", "bfloat16", "float16")  # inference (reference, reward, vLLM) accepts any
TRAINABLE_DTYPES = ("float32", "bfloat16")   # the learner: fp16 would need loss scaling


def torch_dtype(name, role: str):
    """The torch dtype named ``name`` (a torch.dtype passes through); one-line error otherwise."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"{role}: dtype {name!r} is not one of {list(DTYPES)}")
    return getattr(torch, name)

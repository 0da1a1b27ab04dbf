"""Names of the floating-point dtypes an inference model may load in (the learner's own are
core.choices.TrainableDType), and the torch dtype of a name."""
from __future__ import annotations

DTYPES = ("float32", "bfloat16", "float16")  # inference (reference, reward, vLLM) accepts any


def torch_dtype(name, role: str):
    """The torch dtype named ``name`` (a torch.dtype passes through); one-line error otherwise."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"{role}: dtype {name!r} is not one of {list(DTYPES)}")
    return getattr(torch, name)

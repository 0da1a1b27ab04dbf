"""The ceiling and the count behind bench.learner's MFU: a matmul peak measured in the same run,
and the model FLOPs of one PPO update.

The peak is measured rather than read off a data sheet (bench/mfu.py's table) because the
learner runs at fp32 too, and because a data-sheet figure is one no library reaches: the
H200's 989 TFLOP/s dense bf16 against ~790 measured here. MFU against the measured peak
says how far the update is from what this device really does on large square matmuls.

Counting follows bench/mfu.py: 6 N FLOPs per trained token (2 N forward, 4 N backward), N the
trainable parameters. Two counts of the tokens (``update_flops``):
  - ``response``: each response token of the update once (what ``perf/learner_tokens_per_s``
    counts, so what bench/mfu.py's MFU uses): a floor, blind to the epochs and the no-grad forward;
  - ``all``: every sequence position (prompt too) in each of ``epochs`` forward+backward passes,
    plus 2 N per position for the no-grad forward that scores the old log-probs and values.
    Attention's own score/value FLOPs (small at these lengths) are left out, and the LM head,
    which runs on the response columns only, is counted on the prompt columns as well.
"""
from __future__ import annotations

import statistics
import time

import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work: a host clock read before it times the launches only."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    """Seconds ``fn()`` takes, its device work included."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int = 0, rounds: int = 5, per_round: int = 0) -> dict:
    """FLOP/s of n x n x n products at ``dtype`` on ``device``: the median over ``rounds`` of the
    mean of ``per_round`` back-to-back products, after warm-ups. Random inputs: zeros run faster
    than real data on some GPUs. fp32 on CUDA runs as torch is set (TF32 off by default), which is
    also how the learner's fp32 matmuls run."""
    cuda = device.type == "cuda"
    n = n or (8192 if cuda else 1024)  # 8192: fills an H100/H200; 1024: seconds on a 2-core CPU
    per_round = per_round or (10 if cuda else 2)
    gen = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(n, n, device=device, dtype=dtype, generator=gen) for _ in range(2))
    c = torch.empty(n, n, device=device, dtype=dtype)
    run = lambda: [torch.mm(a, b, out=c) for _ in range(per_round)]  # noqa: E731
    for _ in range(2):  # cuBLAS picks its kernel and the clocks come up
        timed(run, device)
    seconds = statistics.median(timed(run, device) for _ in range(rounds)) / per_round
    return {"flops_per_s": 2.0 * n ** 3 / seconds, "n": n, "rounds": rounds, "per_round": per_round,
            "dtype": str(dtype).removeprefix("torch."), "device": str(device), "tf32": tf32_enabled(device)}


def tf32_enabled(device: torch.device) -> bool:
    """Whether fp32 matmuls on ``device`` may use TF32 (a ~7x faster and less precise path on CUDA)."""
    return device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32


def update_flops(params: int, rollouts: int, prompt_tokens: int, new_tokens: int, epochs: int) -> dict:
    """Model FLOPs of one PPO update under the two counts of the module docstring."""
    return {"response": 6.0 * params * rollouts * new_tokens,
            "all": (2.0 + 6.0 * epochs) * params * rollouts * (prompt_tokens + new_tokens)}


def trainable_params(module: torch.nn.Module) -> int:
    """Trainable elements, whole even when ZeRO-3 has partitioned them away (``ds_numel``)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters() if p.requires_grad)


def mfu_line(side: str, seconds: float, flops: dict, peak: float) -> str:
    """The achieved FLOP/s and MFU of one side's median update: bench/mfu.py's count first."""
    resp, full = flops["response"] / seconds, flops["all"] / seconds
    return (f"learner bench: {side:6s} MFU {100 * resp / peak:.3g}% by bench/mfu.py's count (6 N x response "
            f"tokens/s, a floor); {100 * full / peak:.3g}% = {full / 1e12:.4g} TFLOP/s counting every position "
            f"of every pass ((2 + 6 x epochs) N per token)")

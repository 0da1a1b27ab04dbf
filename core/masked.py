"""Masked tensor statistics and the argument checks every PPO function shares.

Conventions used throughout the PPO math (core.masked, core.logprobs, core.kl,
core.advantages, core.ppo; see docs/design/core.md, "Numeric conventions"):
  * ``mask`` is ``[B, T]`` with 1.0 on valid response tokens and 0 on padding;
    sequences are right-padded.
  * Masked functions never read padding positions: they are replaced with 0 via
    ``torch.where`` (not multiplication, so NaN/inf garbage cannot leak).
  * Shape mismatches and masks with no valid token raise ``ValueError``
    instead of silently broadcasting or returning NaN.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch

Tensor = torch.Tensor


# --------------------------------------------------------------------------- validation


def require(ok: bool, message: str) -> None:
    """A ValueError with ``message`` unless ``ok``."""
    if not ok:
        raise ValueError(message)


def check_shapes(fn: str, ref_name: str, ref_shape: Sequence[int], **tensors: Tensor) -> None:
    """Every tensor in ``tensors`` must have exactly ``ref_shape`` (no broadcasting)."""
    ref_shape = tuple(ref_shape)
    for name, t in tensors.items():
        if tuple(t.shape) != ref_shape:
            raise ValueError(
                f"{fn}: {name} shape {tuple(t.shape)} does not match {ref_name} shape {ref_shape}"
            )


def check_masked(fn: str, mask: Tensor, *, two_d: bool = True, nonempty: bool = True,
                 **tensors: Tensor) -> None:
    """Shared checks for masked functions: shapes equal the mask's, mask non-empty
    (``nonempty=False``: the caller checks the count over the global batch instead)."""
    require(not two_d or mask.dim() == 2, f"{fn}: mask must be 2-D [B, T], got shape {tuple(mask.shape)}")
    check_shapes(fn, "mask", mask.shape, **tensors)
    # One host sync; worth it to turn a silent NaN into a loud error.
    require(not nonempty or bool((mask != 0).any()), f"{fn}: mask has no valid tokens")


def zero_pad(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` with 0 wherever ``mask`` [same shape] is 0: selected, not multiplied, so NaN/inf cannot leak."""
    return torch.where(mask != 0, x, torch.zeros((), dtype=x.dtype, device=x.device))


# --------------------------------------------------------------------------- masked statistics


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of ``x`` over entries where ``mask`` != 0 (mask values act as weights).

    ``x`` and ``mask`` have the same shape (any rank). With ``dim=None`` returns a
    scalar; otherwise reduces over ``dim`` and slices with no valid entry give 0
    (they carry no information; callers that average them further should skip them).
    """
    check_masked("masked_mean", mask, two_d=False, x=x)
    m = mask.to(x.dtype)
    weighted = zero_pad(x, mask) * m
    if dim is None:
        return weighted.sum() / m.sum()
    count = m.sum(dim)
    return torch.where(count != 0, weighted.sum(dim) / count.clamp_min(1e-12), 0.0)


def masked_var(x: Tensor, mask: Tensor) -> Tensor:
    """Biased (population) variance of the valid entries of ``x``, as a scalar."""
    check_masked("masked_var", mask, two_d=False, x=x)
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask)


def local_sums(values: list) -> list:
    """The default ``reduce``: one process holds the whole batch, so its sums are the global ones."""
    return list(values)


def masked_moments(fn: str, xs: Sequence[Tensor], mask: Tensor, reduce) -> Tuple[list, list]:
    """(means, biased variances) of each x in ``xs`` over the valid entries of ``mask``.

    ``reduce`` turns this process's partial sums into sums over the whole batch; it is
    called twice (sums and count, then squared deviations from the global means), so the
    variance is the two-pass one, as precise as ``masked_var``.
    """
    m = mask.to(xs[0].dtype)
    *totals, count = reduce([(zero_pad(x, mask) * m).sum() for x in xs] + [m.sum()])
    require(bool(count != 0), f"{fn}: mask has no valid tokens")
    means = [total / count for total in totals]
    squares = reduce([(zero_pad((x - mu) ** 2, mask) * m).sum() for x, mu in zip(xs, means)])
    return means, [sq / count for sq in squares]


def whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8, *,
           reduce: Callable[[list], list] = local_sums) -> Tensor:
    """Normalise ``x`` [B, T] (any shape equal to ``mask``'s) to unit variance with
    statistics of valid entries only; returns the same shape, 0 on padding.

    ``shift_mean=False`` adds the mean back, i.e. only rescales (used for rewards, where
    the sign carries meaning). Statistics cover the whole batch: by default the local
    one; when the batch is split over processes, ``reduce`` takes a list of local
    scalars (0-d tensors) and returns their sums over all processes, in order (an
    all-reduce); a process may then hold no valid entry as long as some process does.
    """
    fn = "whiten"
    check_masked(fn, mask, two_d=False, nonempty=False, x=x)
    (mean,), (var,) = masked_moments(fn, [x], mask, reduce)
    var = torch.as_tensor(var, dtype=x.dtype, device=x.device)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return zero_pad(out, mask)


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor, *,
                       reduce: Callable[[list], list] = local_sums) -> Tensor:
    """1 - Var(R - V) / Var(R) over valid tokens, as a detached 0-d tensor.

    values, returns, mask: [B, T]. 1 is a perfect critic, 0 no better than a constant,
    negative worse. If the returns have zero variance the ratio is undefined and NaN is
    returned. ``reduce``: as in ``whiten``, for a batch split over processes.
    """
    fn = "explained_variance"
    check_masked(fn, mask, nonempty=False, values=values, returns=returns)
    with torch.no_grad():
        _, (var_r, var_resid) = masked_moments(fn, [returns, returns - values], mask, reduce)
        var_r = torch.as_tensor(var_r, dtype=returns.dtype, device=returns.device)
        if bool(var_r == 0):
            return torch.full_like(var_r, float("nan"))
        return 1.0 - var_resid / var_r


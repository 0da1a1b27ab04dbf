"""The KL to the reference: per-token estimators and the controllers of its coefficient beta.
Conventions as in core.masked.
"""

from __future__ import annotations

import math

import torch

from core.choices import KL_ESTIMATORS
from core.masked import check_shapes, require

Tensor = torch.Tensor


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token estimate [B, T] of KL(pi || ref) from samples drawn from pi.

    With r = logprobs - ref_logprobs (Schulman, "Approximating KL divergence"):
      k1 = r                     unbiased, can be negative, high variance
      k2 = 0.5 * r**2            biased, >= 0, low variance
      k3 = exp(-r) - 1 + r       unbiased, >= 0
    """
    fn = "kl_estimate"
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"{fn}: unknown estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
    check_shapes(fn, "ref_logprobs", ref_logprobs.shape, logprobs=logprobs)
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    # expm1 keeps precision for small r; the clamp removes rounding below the true
    # minimum of 0 (k3 is non-negative mathematically).
    return (torch.expm1(-log_ratio) + log_ratio).clamp_min(0.0)


class FixedKLController:
    """Constant KL coefficient; ``update`` is a no-op kept for interface parity."""

    def __init__(self, beta: float):
        require(beta >= 0 and math.isfinite(beta),
                f"FixedKLController: beta must be finite and >= 0, got {beta}")
        self.value = float(beta)

    def update(self, current_kl: float, n_steps: int) -> None:
        return None


class AdaptiveKLController:
    """Proportional KL controller of Ziegler et al. 2019.

    error = clip(current_kl / target - 1, -0.2, 0.2);
    beta <- beta * (1 + error * n_steps / horizon).
    The clipping bounds how fast beta moves when the KL estimate is noisy.
    """

    def __init__(self, init_beta: float, target: float, horizon: float):
        name = "AdaptiveKLController"
        require(init_beta >= 0 and math.isfinite(init_beta),
                f"{name}: init_beta must be finite and >= 0, got {init_beta}")
        require(target > 0, f"{name}: target must be > 0, got {target}")
        require(horizon > 0, f"{name}: horizon must be > 0, got {horizon}")
        self.value = float(init_beta)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        current_kl = float(current_kl)
        fn = "AdaptiveKLController.update"
        require(math.isfinite(current_kl), f"{fn}: current_kl must be finite, got {current_kl}")
        require(n_steps >= 0, f"{fn}: n_steps must be >= 0, got {n_steps}")
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

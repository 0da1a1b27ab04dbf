"""The KL to the reference: per-token estimators and the controllers of its coefficient beta.
Conventions as in core.masked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from core.choices import KL_ESTIMATORS, KLEstimator, KLPlacement, kl_placement_error
from core.masked import check_shapes, require

Tensor = torch.Tensor

LOG_RATIO_LIMIT = 20.0  # |log pi/ref| (and PPO's |log pi/pi_old|) beyond this is clamped before exp (e^20 ~ 4.9e8)
K3_LIMIT = 10.0  # k3 in the loss is clamped to [0, K3_LIMIT] per token, as verl's low_var_kl


def _k3_grad_bound(limit: float) -> float:
    """The largest |d k3 / d log pi| = e^x - 1 (x = log ref/pi) left by clamping k3 to ``limit``:
    at the x* where e^x* - x* - 1 = limit, i.e. limit + x* (x* = log(limit + 1 + x*))."""
    x = 2.0
    for _ in range(60):  # a contraction (slope 1 / (limit + 1 + x)): converges to double precision
        x = math.log(limit + 1.0 + x)
    return limit + x


K3_GRAD_BOUND = _k3_grad_bound(K3_LIMIT)  # 12.61: one token's largest k3 gradient in the loss


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


def bounded_kl(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """``kl_estimate`` [B, T] for a loss term, in at least float32, with one token's gradient
    bounded as verl's kl_penalty does: the log-ratio clamped to +-LOG_RATIO_LIMIT, k3 to
    [0, K3_LIMIT]. Unclamped, k3's gradient 1 - pi_ref/pi is -e^12 ~ -1.6e5 at log pi/ref = -12;
    clamped it is at most K3_GRAD_BOUND (12.61) in size, and 0 past the clamp (such a token
    gets no pull from the KL at all, as in verl). k2's gradient is the log-ratio itself, so
    at most LOG_RATIO_LIMIT."""
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    r = (logprobs.to(dtype) - ref_logprobs.to(dtype)).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    kl = kl_estimate(r, torch.zeros_like(r), estimator)
    return kl.clamp(max=K3_LIMIT) if estimator == "k3" else kl


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


@dataclass(frozen=True)
class KLPenalty:
    """The KL-to-reference penalty of one step, as the driver hands it to the reward shaping
    (core.annotate.RewardShaping.for_step) and to the learner's update: beta as the controller
    had it when the driver built this value, the estimator, and where the penalty acts
    (``ppo.kl.placement``). The driver builds one from the controller whenever it hands one
    on, so the controller alone moves beta (``AdaptiveKLController.update`` reads the batch's
    measured KL, not this value). Whether the KL is a loss term is asked of ``in_loss`` alone."""
    beta: float = 0.0
    estimator: KLEstimator = "k1"
    placement: KLPlacement = "reward"

    def __post_init__(self) -> None:
        problem = kl_placement_error(self.placement, self.estimator)
        if problem:
            raise ValueError(f"KLPenalty: {problem}")

    @property
    def in_loss(self) -> bool:
        """True: the learner adds beta x the estimator's aggregate to its loss (the GRPO family)."""
        return self.placement == "loss"

    @property
    def reward_beta(self) -> float:
        """beta of -beta x KL per token in the rewards; 0 when the KL is a loss term instead,
        where the rewards are the scores alone (the KL is still measured)."""
        return 0.0 if self.in_loss else self.beta


NO_KL = KLPenalty()  # a learner update without a KL term (the rewards' beta is 0 too)

"""PPO's named choices (KL estimators and placements, loss aggregations, off-policy corrections)
as Literal types, with the tuples of their names and the one cross-check between them.

No torch here: the run's config validates against these without importing the math.
"""
from __future__ import annotations

from typing import Literal, Optional, get_args

KLEstimator = Literal["k1", "k2", "k3"]
KLPlacement = Literal["reward", "loss"]
LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
OffPolicyCorrection = Literal["none", "tis", "decoupled"]

KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)
KL_PLACEMENTS: tuple[str, ...] = get_args(KLPlacement)
AGG_MODES: tuple[str, ...] = get_args(LossAggregation)
OFF_POLICY_MODES: tuple[str, ...] = get_args(OffPolicyCorrection)


def kl_placement_error(placement: str, estimator: str) -> Optional[str]:
    """Why ``estimator`` cannot serve at ``placement``, or None when it can.

    In the reward PPO treats the penalty as a constant, so only k1's expectation has the KL's
    gradient (k2 and k3 there pull with a fraction of it, k3 away from the reference when
    far). In the loss the gradient flows through log pi: k1 has zero expected gradient there,
    k2 gives grad KL(pi || ref) and k3 grad KL(ref || pi) (the GRPO family's low-variance KL).
    """
    if placement not in KL_PLACEMENTS:
        return f"ppo.kl.placement={placement!r} is unknown; use one of {', '.join(KL_PLACEMENTS)}"
    if estimator not in KL_ESTIMATORS:
        return f"ppo.kl.estimator={estimator!r} is unknown; use one of {', '.join(KL_ESTIMATORS)}"
    if placement == "reward" and estimator != "k1":
        return (f"ppo.kl.estimator={estimator} in the reward does not give the KL's gradient (PPO treats "
                "rewards as constants); use k1 there, or ppo.kl.placement=loss to train on "
                f"{estimator} as a loss term")
    if placement == "loss" and estimator == "k1":
        return ("ppo.kl.estimator=k1 in the loss has zero expected gradient; use k3 (the low-variance "
                "KL of the GRPO family) or k2 with ppo.kl.placement=loss, or placement=reward for k1")
    return None

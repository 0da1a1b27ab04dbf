"""The named choices of the configs as Literal types: PPO's (KL estimators and placements, loss
aggregations, off-policy corrections, where pi_old comes from, advantage estimators), the learner's (optimizer, lr
decay, dtype, critic, weight transport) and the run's (mode, CPU threads, placement, pair labels), with
the tuples of PPO's names and the one cross-check between them. A config key typed with one of
these is checked against it by the loader (core/schema.py), never by a hand-written test.

No torch here: the run's config validates against these without importing the math.
"""
from __future__ import annotations

from typing import Literal, Optional, get_args

from core.schema import choice_error

KLEstimator = Literal["k1", "k2", "k3"]
KLPlacement = Literal["reward", "loss"]
LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
OffPolicyCorrection = Literal["none", "tis", "decoupled"]
OldLogprobs = Literal["recompute", "behaviour"]  # where the PPO ratio's pi_old comes from (learner/update.py)
Optimizer = Literal["adamw", "sgd"]
LRDecay = Literal["linear", "cosine", "constant"]
TrainableDType = Literal["float32", "bfloat16"]  # the learner's: fp16 would need loss scaling
Precision = Literal["auto", "float32", "bfloat16"]  # the job's model.dtype (core/dtypes.py resolves auto)
Critic = Literal["shared", "separate", "none"]
# The advantage estimators (core/estimators.py holds the math); the critic-free ones train no value model.
AdvantageEstimator = Literal["gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
WeightSync = Literal["cpu", "nccl", "ipc"]  # learner -> generator transports (learner/weight_sync.py, *_sync.py)
RunMode = Literal["sync", "async"]
CPUThreads = Literal["phase", "reserved"]  # cluster/runtime/threads.py
PlacementStrategy = Literal["pack", "spread"]  # a pool's replicas by node (cluster/runtime/placement.py)
PairLabels = Literal["hard", "bradley_terry"]  # cluster/demo/sentiment.py label_pairs

KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)
KL_PLACEMENTS: tuple[str, ...] = get_args(KLPlacement)
AGG_MODES: tuple[str, ...] = get_args(LossAggregation)
OFF_POLICY_MODES: tuple[str, ...] = get_args(OffPolicyCorrection)
ESTIMATOR_NAMES: tuple[str, ...] = get_args(AdvantageEstimator)
CRITIC_FREE: tuple[str, ...] = ESTIMATOR_NAMES[1:]   # every estimator but gae
GROUP_ESTIMATORS: tuple[str, ...] = ("grpo", "rloo", "reinforce_pp_baseline")  # baseline from a prompt's samples


def kl_placement_error(placement: str, estimator: str) -> Optional[str]:
    """Why ``estimator`` cannot serve at ``placement``, or None when it can.

    In the reward PPO treats the penalty as a constant, so only k1's expectation has the KL's
    gradient (k2 and k3 there pull with a fraction of it, k3 away from the reference when
    far). In the loss the gradient flows through log pi: k1 has zero expected gradient there,
    k2 gives grad KL(pi || ref) and k3 grad KL(ref || pi) (the GRPO family's low-variance KL).
    """
    unknown = (choice_error("ppo.kl.placement", placement, KL_PLACEMENTS)
               or choice_error("ppo.kl.estimator", estimator, KL_ESTIMATORS))
    if unknown:
        return unknown
    if placement == "reward" and estimator != "k1":
        return (f"ppo.kl.estimator={estimator} in the reward does not give the KL's gradient (PPO treats "
                "rewards as constants); use k1 there, or ppo.kl.placement=loss to train on "
                f"{estimator} as a loss term")
    if placement == "loss" and estimator == "k1":
        return ("ppo.kl.estimator=k1 in the loss has zero expected gradient; use k3 (the low-variance "
                "KL of the GRPO family) or k2 with ppo.kl.placement=loss, or placement=reward for k1")
    return None

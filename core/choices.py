"""The named choices of the configs as Literal types: PPO's (KL estimators and placements, loss
aggregations, off-policy corrections, where pi_old comes from, advantage estimators), the learner's (optimizer, lr
decay, dtype, critic, weight transport) and the run's (mode, CPU threads, placement, pair labels), with
the tuples of PPO's names and the one cross-check between them. The advantage estimators are a
table (``ESTIMATOR_TABLE``, one row each) that their Literal, help and checks derive from. A config
key typed with one of these is checked against it by the loader (core/infra/schema.py), never by a
hand-written test.

No torch here: the run's config validates against these without importing the math.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, get_args

from core.infra.schema import choice_error


@dataclass(frozen=True)
class EstimatorRow:
    """One advantage estimator: its config name (``ppo.advantage``), whether it reads a critic's
    values, whether it baselines a sample against the other samples of its prompt (its group), whether
    it discounts rewards by ``ppo.gamma`` (the outcome estimators give every token its sequence's
    score undiscounted), the name of its function in core/estimators.py and its help. The function goes by name so that
    this table, and the configs checked against it, import no torch."""
    name: str
    needs_critic: bool
    uses_groups: bool
    discounts: bool
    function: str
    help: str


# Every advantage estimator, one row each: the config's choices, its help text and the checks on
# critics and groups all derive from here (docs/extending.md: adding an estimator).
ESTIMATOR_TABLE: tuple[EstimatorRow, ...] = (
    EstimatorRow(name="gae", needs_critic=True, uses_groups=False, discounts=True, function="gae_advantages",
                 help="the critic's values"),
    EstimatorRow(name="grpo", needs_critic=False, uses_groups=True, discounts=False, function="grpo_advantages",
                 help="the group's mean and std"),
    EstimatorRow(name="rloo", needs_critic=False, uses_groups=True, discounts=False, function="rloo_advantages",
                 help="the mean of the group's other samples"),
    EstimatorRow(name="reinforce_pp", needs_critic=False, uses_groups=False, discounts=True,
                 function="reinforce_pp_advantages", help="returns whitened over the batch"),
    EstimatorRow(name="reinforce_pp_baseline", needs_critic=False, uses_groups=True, discounts=False,
                 function="reinforce_pp_baseline_advantages", help="the group's mean, then whitened"),
)

KLEstimator = Literal["k1", "k2", "k3"]
KLPlacement = Literal["reward", "loss"]
LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
OffPolicyCorrection = Literal["none", "tis", "decoupled"]
OldLogprobs = Literal["recompute", "behaviour"]  # where the PPO ratio's pi_old comes from (learner/objectives/ppo.py)
Optimizer = Literal["adamw", "sgd"]
LRDecay = Literal["linear", "cosine", "constant"]
TrainableDType = Literal["float32", "bfloat16"]  # the learner's: fp16 would need loss scaling
Precision = Literal["auto", "float32", "bfloat16"]  # the job's model.dtype (core/infra/dtypes.py resolves auto)
Critic = Literal["shared", "separate", "none"]
LoraInit = Literal["default", "gaussian"]  # learner/lora.py: both start with B = 0, at the base model
ENGINE_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the adapter ranks vLLM's engine is started with
AdvantageEstimator = Literal[tuple(row.name for row in ESTIMATOR_TABLE)]


@dataclass(frozen=True)
class TransportRow:
    """One learner -> generator weight transport (learner/transport/ sends, actors/weight_receiver.py
    receives): what it needs CUDA for on each side (None: no GPU), and whether it needs the
    learner to be one rank (CUDA IPC shares rank 0's GPU with the generators)."""
    name: str
    learner_cuda: Optional[str] = None
    generator_cuda: Optional[str] = None
    one_learner_rank: bool = False


# The one table of weight transports (learner.weight_sync); the senders are looked up by these
# names in SENDERS (learner/export.py).
TRANSPORT_TABLE = (
    TransportRow("cpu"),
    TransportRow("nccl", learner_cuda="NCCL broadcast from its GPU",
                 generator_cuda="NCCL broadcast into vLLM's GPU workers"),
    TransportRow("ipc", learner_cuda="CUDA IPC handles to its own GPU's memory",
                 generator_cuda="CUDA IPC into vLLM's GPU workers", one_learner_rank=True),
)
TRANSPORTS = {row.name: row for row in TRANSPORT_TABLE}
_QUOTED = [repr(row.name) for row in TRANSPORT_TABLE]
TRANSPORT_NAMES = f"{', '.join(_QUOTED[:-1])} or {_QUOTED[-1]}"  # for messages: 'cpu', 'nccl' or 'ipc'
WeightSync = Literal[tuple(row.name for row in TRANSPORT_TABLE)]
RunMode = Literal["sync", "async"]
CPUThreads = Literal["phase", "reserved"]  # cluster/runtime/pools/threads.py
PlacementStrategy = Literal["pack", "spread"]  # a pool's replicas by node (cluster/runtime/pools/placement.py)
PairLabels = Literal["hard", "bradley_terry"]  # cluster/demo/sentiment.py label_pairs

KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)
KL_PLACEMENTS: tuple[str, ...] = get_args(KLPlacement)
AGG_MODES: tuple[str, ...] = get_args(LossAggregation)
OFF_POLICY_MODES: tuple[str, ...] = get_args(OffPolicyCorrection)
ESTIMATOR_NAMES: tuple[str, ...] = get_args(AdvantageEstimator)
ESTIMATOR_HELP = ("advantage estimator (core/estimators.py): "
                  + " | ".join(f"{row.name} ({row.help}{'' if row.needs_critic else '; critic-free'})"
                               for row in ESTIMATOR_TABLE))


def estimator_row(name: str) -> EstimatorRow:
    """The row of the estimator called ``name``; a one-line error listing the valid names otherwise."""
    for row in ESTIMATOR_TABLE:
        if row.name == name:
            return row
    raise ValueError(f"advantage estimator {name!r} is unknown; use one of {', '.join(ESTIMATOR_NAMES)}")


def critic_free_names() -> str:
    """The estimators that train no value model, as a config's help lists choices."""
    return " | ".join(row.name for row in ESTIMATOR_TABLE if not row.needs_critic)


def discounting_names() -> str:
    """The estimators that ``ppo.gamma`` discounts, as a help text lists them."""
    return " and ".join(row.name for row in ESTIMATOR_TABLE if row.discounts)


def outcome_names() -> str:
    """The estimators that ``ppo.gamma`` leaves alone (every token gets its sequence's score)."""
    return ", ".join(row.name for row in ESTIMATOR_TABLE if not row.discounts)


def gamma_error(gamma: float, estimator: str, at: str = "ppo") -> Optional[str]:
    """Why ``gamma`` < 1 has no effect with ``estimator``, or None when it has (or is 1)."""
    if gamma == 1 or estimator not in ESTIMATOR_NAMES or estimator_row(estimator).discounts:
        return None
    return (f"{at}.gamma={gamma} has no effect with {at}.advantage={estimator}: an outcome estimator gives every "
            f"token its sequence's score undiscounted; leave gamma at 1, or use {discounting_names()}")


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

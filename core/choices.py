"""The named choices of the configs as Literal types: PPO's (KL estimators and placements, loss
aggregations, rollout corrections, policy losses, where pi_old comes from, advantage estimators),
the learner's (optimizer, lr decay, dtype, critic, weight transport) and the run's (mode, CPU
threads, placement, pair labels), with the tuples of PPO's names and the one cross-check between
them. The advantage estimators, the rollout corrections and the policy losses are tables
(``ESTIMATOR_TABLE``, ``CORRECTION_TABLE``, ``POLICY_LOSS_TABLE``, one row each) that their
Literal, help and checks derive from. A config key typed with one of these is checked against it
by the loader (core/infra/schema.py), never by a hand-written test.

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


@dataclass(frozen=True)
class CorrectionRow:
    """One rollout-correction preset (``ppo.off_policy``): its name, the function of
    core/corrections.py that computes its weights (by name, so the config imports no torch), its
    default rejection band (``ppo.rs_lower``, ``ppo.rs_upper``; None: it rejects nothing by a
    band), the peer preset it matches and its help."""
    name: str
    function: str
    band: Optional[tuple[float, float]]
    peer: str
    help: str


# Every rollout correction, one row each (docs/guide/corrections.md has each formula). The bands
# default to verl's (RolloutCorrectionConfig's presets); IcePop's to its paper's.
CORRECTION_TABLE: tuple[CorrectionRow, ...] = (
    CorrectionRow("none", "no_correction", None, "-", "weight 1: the rollouts are treated as on-policy"),
    CorrectionRow("tis", "token_tis", None, "verl decoupled_token_is (Token-TIS)",
                  "token-level truncated IS: min(w_t, is_cap)"),
    CorrectionRow("decoupled", "decoupled_drop", None, "AReaL decoupled PPO",
                  "w_t where w_t <= is_cap, else 0"),
    CorrectionRow("seq_tis", "seq_tis", None, "verl decoupled_seq_is (Seq-TIS)",
                  "sequence-level truncated IS: min(prod_t w_t, is_cap) on every token of the row"),
    CorrectionRow("seq_mis", "seq_mis", (0.5, 2.0), "verl decoupled_seq_is_rs (Seq-MIS)",
                  "Seq-TIS, the whole row rejected when prod_t w_t is outside [rs_lower, rs_upper]"),
    CorrectionRow("geo_rs", "geo_rs", (0.999, 1.001), "verl decoupled_geo_rs (Geo-RS)",
                  "weight 1, the row rejected when its geometric-mean ratio is outside [rs_lower, rs_upper]"),
    CorrectionRow("geo_rs_token_tis", "geo_rs_token_tis", (0.999, 1.001),
                  "verl decoupled_geo_rs_token_tis", "Geo-RS's rejection with Token-TIS's weights"),
    CorrectionRow("icepop", "icepop", (0.5, 5.0), "verl decoupled_token_icepop (IcePop)",
                  "w_t where rs_lower <= w_t <= rs_upper, else 0"),
)


@dataclass(frozen=True)
class PolicyLossRow:
    """One policy loss (``ppo.policy_loss``): its name, the aggregation it defaults ``ppo.agg`` to,
    whether that aggregation is the only one it takes, and its help."""
    name: str
    agg: str
    agg_fixed: bool
    help: str


# Every policy loss, one row each; learner/objectives/loss_terms.py maps the names to the functions.
POLICY_LOSS_TABLE: tuple[PolicyLossRow, ...] = (
    PolicyLossRow("ppo", "token-mean", False, "clipped token ratio (core.ppo.policy_loss)"),
    PolicyLossRow("gspo", "seq-mean-token-mean", True, "GSPO: clipped sequence ratio, length-normalised"),
    PolicyLossRow("cispo", "token-mean", False, "CISPO: clipped, stop-gradient IS weight times log pi"),
)

KLEstimator = Literal["k1", "k2", "k3"]
KLPlacement = Literal["reward", "loss"]
LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
OffPolicyCorrection = Literal[tuple(row.name for row in CORRECTION_TABLE)]
PolicyLoss = Literal[tuple(row.name for row in POLICY_LOSS_TABLE)]
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
POLICY_LOSSES: tuple[str, ...] = get_args(PolicyLoss)
OFF_POLICY_HELP = ("rollout correction for tokens sampled by other weights (core/corrections.py): "
                   + " | ".join(f"{row.name} ({row.help})" for row in CORRECTION_TABLE))
POLICY_LOSS_HELP = ("policy loss: " + " | ".join(f"{row.name} ({row.help}; ppo.agg "
                                                 f"{'must be' if row.agg_fixed else 'defaults to'} {row.agg})"
                                                 for row in POLICY_LOSS_TABLE)
                    + "; GSPO's paper clips at clip_low=3e-4, clip_high=4e-4")
# The masking presets' default bands, as the help of ppo.rs_lower and ppo.rs_upper lists them.
BAND_DEFAULTS = tuple(", ".join(f"{row.name} {row.band[end]}" for row in CORRECTION_TABLE if row.band)
                      for end in (0, 1))
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


def correction_row(name: str) -> CorrectionRow:
    """The preset called ``name``; a one-line error listing the valid names otherwise."""
    for row in CORRECTION_TABLE:
        if row.name == name:
            return row
    raise ValueError(choice_error("ppo.off_policy", name, OFF_POLICY_MODES))


def policy_loss_row(name: str) -> PolicyLossRow:
    """The policy loss called ``name``; a one-line error listing the valid names otherwise."""
    for row in POLICY_LOSS_TABLE:
        if row.name == name:
            return row
    raise ValueError(choice_error("ppo.policy_loss", name, POLICY_LOSSES))


def resolved_band(preset: str, lower: Optional[float], upper: Optional[float]) -> tuple[float, float]:
    """(lower, upper) of ``preset``'s band: its row's default where a bound is None."""
    default = correction_row(preset).band or (0.5, 2.0)
    return (default[0] if lower is None else lower, default[1] if upper is None else upper)


def band_error(preset: str, lower: Optional[float], upper: Optional[float], at: str = "ppo") -> Optional[str]:
    """Why ``ppo.rs_lower``/``rs_upper`` cannot serve ``preset``, or None when they can (or are unset)."""
    if lower is None and upper is None:
        return None
    if correction_row(preset).band is None:
        banded = ", ".join(row.name for row in CORRECTION_TABLE if row.band)
        return (f"{at}.rs_lower/rs_upper bound the masking presets ({banded}); {at}.off_policy={preset} masks "
                "nothing by a band: leave them out")
    lo, hi = resolved_band(preset, lower, upper)
    if not (0 < lo < hi < float("inf")):
        return f"{at}.rs_lower={lo} and {at}.rs_upper={hi} make no band: need 0 < rs_lower < rs_upper"
    return None


def policy_loss_error(name: str, agg: Optional[str], dual_clip: Optional[float], at: str = "ppo") -> Optional[str]:
    """Why ``ppo.agg`` or ``ppo.dual_clip`` contradicts the policy loss ``name``, or None."""
    row = policy_loss_row(name)
    if row.agg_fixed and agg != row.agg:
        return (f"{at}.policy_loss={name} aggregates {row.agg} (its length normalisation); set {at}.agg="
                f"{row.agg} or leave it out, not {agg}")
    if dual_clip is not None and name != "ppo":
        return f"{at}.dual_clip applies to {at}.policy_loss=ppo only; leave it out with {name}"
    return None


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

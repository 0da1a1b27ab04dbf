"""Typed configuration of the learner: optimiser, PPO update, DeepSpeed engine.

Each setting is declared once, here (learner.lora's in learner/lora_config.py):
cluster/config/ppo.py builds its ``learner`` and ``ppo`` sections from these classes instead
of repeating them. Every class is a frozen config class (core/infra/schema.py: each key's help
is its field metadata, a named choice is a Literal type from core/choices.py) and has
``validate(world_size)`` raising a one-line ValueError that names the field and the fix, so a
bad YAML fails at start-up, not mid-run inside DeepSpeed. ``from_dict`` accepts the nested
plain dicts a YAML loader produces (and validates them, since nothing upstream has).
"""
from __future__ import annotations

import math
from dataclasses import asdict, fields
from typing import Optional

from core.choices import (
    BAND_DEFAULTS,
    ESTIMATOR_HELP,
    OFF_POLICY_HELP,
    POLICY_LOSS_HELP,
    POLICY_LOSSES,
    TRANSPORTS,
    AdvantageEstimator,
    Critic,
    LossAggregation,
    LRDecay,
    OffPolicyCorrection,
    OldLogprobs,
    Optimizer,
    PolicyLoss,
    TrainableDType,
    WeightSync,
    band_error,
    critic_free_names,
    discounting_names,
    estimator_row,
    gamma_error,
    outcome_names,
    policy_loss_error,
    policy_loss_row,
)
from core.infra.schema import check_choices, config_class, setting
from learner.lora_config import LoraConfig

# The GPU transports, with what they need CUDA for (checked on each learner rank: check_device).


def _fail(message: str) -> None:
    raise ValueError(message)


def _from_dict(cls, data: dict, where: str):
    """Build a dataclass from a dict, naming unknown keys (typos) instead of ignoring them."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        _fail(f"{where}: unknown key(s) {unknown}; valid keys: {sorted(known)}")
    return cls(**data)


@config_class
class OptimConfig:
    """The optimizer and its learning-rate schedule."""
    optimizer: Optimizer = setting("adamw", "adamw | sgd (sgd is scale-sensitive: used to test gradient sums)")
    lr: float = setting(1e-5, "peak learning rate, reached at the end of warm-up")
    weight_decay: float = setting(0.0, "decoupled (AdamW) / L2 (SGD) weight decay")
    betas: tuple = setting((0.9, 0.95), "Adam moment decays")
    eps: float = setting(1e-8, "Adam denominator epsilon")
    warmup_steps: int = setting(0, "optimizer steps of linear warm-up from 0 to lr")
    total_steps: int = setting(0, "optimizer steps over which lr decays to min_lr_ratio*lr; "
                                  "0 = constant after warm-up")
    decay: LRDecay = setting("linear", "linear | cosine | constant: shape of the decay after warm-up")
    min_lr_ratio: float = setting(0.0, "floor of the decay as a fraction of lr")
    grad_clip: float = setting(1.0, "max global gradient L2 norm; 0 disables clipping")

    def validate(self, world_size: int = 1) -> None:
        p = "learner.optim"
        check_choices(self, p)
        if not (self.lr > 0 and math.isfinite(self.lr)):
            _fail(f"{p}.lr={self.lr} must be a finite number > 0")
        if self.weight_decay < 0:
            _fail(f"{p}.weight_decay={self.weight_decay} must be >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            _fail(f"{p}.betas={self.betas} must be two numbers in [0, 1)")
        if self.eps <= 0:
            _fail(f"{p}.eps={self.eps} must be > 0")
        if self.warmup_steps < 0 or self.total_steps < 0:
            _fail(f"{p}.warmup_steps and total_steps must be >= 0 "
                  f"(got {self.warmup_steps}, {self.total_steps})")
        if self.total_steps and self.total_steps < self.warmup_steps:
            _fail(f"{p}.total_steps={self.total_steps} is below warmup_steps={self.warmup_steps}; "
                  "raise total_steps or set it to 0 for a constant lr after warm-up")
        if not 0 <= self.min_lr_ratio <= 1:
            _fail(f"{p}.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.grad_clip < 0:
            _fail(f"{p}.grad_clip={self.grad_clip} must be >= 0 (0 disables clipping)")

    def build(self, params):
        """A plain torch optimizer: DeepSpeed's fused CPU Adam needs a C++ build.

        AdamW is torch's fused kernel (CPU and CUDA): one pass over each tensor instead of
        a chain of foreach ops: 24 against 120 ms a step for 32M parameters on 2 CPU cores.
        """
        import torch

        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.lr, weight_decay=self.weight_decay)
        return torch.optim.AdamW(params, lr=self.lr, betas=tuple(self.betas), eps=self.eps,
                                 weight_decay=self.weight_decay, fused=True)

    def lr_factor(self, step: int) -> float:
        """Multiplier of ``lr`` at optimizer step ``step`` (0-based): warm-up, then decay."""
        if self.warmup_steps and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if not self.total_steps or self.decay == "constant":
            return 1.0
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min(max(step - self.warmup_steps, 0) / span, 1.0)
        shape = 1.0 - progress if self.decay == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape


@config_class
class PPOConfig:
    """The PPO update: epochs, batch sizes, clipping, loss weights, GAE, off-policy correction."""
    ppo_epochs: int = setting(1, "passes over the batch per train() call")
    minibatch_size: int = setting(8, "rollouts per optimizer step, summed over all ranks")
    micro_batch_size: int = setting(2, "rollouts per forward/backward on one rank (gradient accumulation)")
    packing: bool = setting(True, "each micro-batch as one row of its real tokens, no padding, attended per "
                                  "sequence (learner/packing.py, core/modeling/varlen_attention.py); false: padded "
                                  "rows")
    max_tokens_per_micro_batch: int = setting(0, "with packing: micro-batches of at most this many tokens, not "
                                                 "micro_batch_size rows (a longer rollout alone); 0 = off")
    clip_low: float = setting(0.2, "ratio clipped below at 1 - clip_low")
    clip_high: Optional[float] = setting(None, "ratio clipped above at 1 + clip_high; None = clip_low")
    dual_clip: Optional[float] = setting(None, "c > 1 caps negative-advantage loss at -A*c; None disables")
    value_clip: Optional[float] = setting(0.2, "value updates clipped to old value +- this; None disables")
    vf_coef: float = setting(0.1, "weight of the value loss in the total loss")
    entropy_coef: float = setting(0.0, "weight of the entropy bonus (subtracted from the loss)")
    ptx_coef: float = setting(0.0, "gamma of InstructGPT's PPO-ptx: weight of the pretraining LM loss "
                                   "(text: ptx.*)")
    advantage: AdvantageEstimator = setting("gae", ESTIMATOR_HELP)
    group_std: bool = setting(True, "grpo: divide each advantage by its group's score std; false: Dr. GRPO "
                                    "(the group mean is taken off, nothing divided)")
    gamma: float = setting(1.0, f"discount of the returns of {discounting_names()}; the outcome estimators "
                                f"({outcome_names()}) take none and refuse gamma < 1")
    lam: float = setting(0.95, "GAE lambda")
    agg: Optional[LossAggregation] = setting(None, "loss aggregation, see core.ppo.aggregate_loss; null = the "
                                                   "policy loss's (see policy_loss)")
    policy_loss: PolicyLoss = setting("ppo", POLICY_LOSS_HELP)
    whiten_advantages: bool = setting(True, "gae: normalise advantages over the global batch (REINFORCE++ always "
                                            "does; grpo and rloo never)")
    shuffle: bool = setting(True, "shuffle rollouts into minibatches each epoch (seeded)")
    off_policy: OffPolicyCorrection = setting("tis", OFF_POLICY_HELP)
    is_cap: float = setting(2.0, "importance-weight cap (verl's rollout_is_threshold): tis, seq_tis, seq_mis and "
                                 "geo_rs_token_tis truncate weights to it, decoupled drops tokens above it")
    rs_lower: Optional[float] = setting(None, f"lower end of the masking presets' band (verl's rollout_rs_threshold "
                                              f"lower_upper); null = the preset's: {BAND_DEFAULTS[0]}")
    rs_upper: Optional[float] = setting(None, f"upper end of that band; null = the preset's: {BAND_DEFAULTS[1]}")
    old_logprobs: OldLogprobs = setting("recompute", "the ratio's pi_old: recompute (a learner forward) | "
                                                     "behaviour (the sampler's log-probs; sync mode only)")

    def __post_init__(self) -> None:
        # agg left out takes the policy loss's; one written out stays, for validate to check.
        if self.agg is None and self.policy_loss in POLICY_LOSSES:
            object.__setattr__(self, "agg", policy_loss_row(self.policy_loss).agg)

    def validate(self, world_size: int = 1, at: str = "learner.ppo") -> None:
        """``at``: where the user writes this section (a PPO job's is ``ppo``), for the messages."""
        p = at
        check_choices(self, p)
        for name in ("ppo_epochs", "minibatch_size", "micro_batch_size"):
            if getattr(self, name) < 1:
                _fail(f"{p}.{name}={getattr(self, name)} must be >= 1")
        if self.max_tokens_per_micro_batch < 0 or (self.max_tokens_per_micro_batch and not self.packing):
            _fail(f"{p}.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch}: use >= 0, with {p}.packing=true")
        per_step = world_size * self.micro_batch_size
        if self.minibatch_size % per_step:
            _fail(f"{p}.minibatch_size={self.minibatch_size} is not divisible by world_size*micro_batch_size="
                  f"{world_size}*{self.micro_batch_size}={per_step}; make minibatch_size a multiple of {per_step}")
        if not 0 < self.clip_low < 1:
            _fail(f"{p}.clip_low={self.clip_low} must be in (0, 1)")
        if self.clip_high is not None and self.clip_high <= 0:
            _fail(f"{p}.clip_high={self.clip_high} must be > 0 or null")
        if self.dual_clip is not None and self.dual_clip <= 1:
            _fail(f"{p}.dual_clip={self.dual_clip} must be > 1 or null")
        if self.value_clip is not None and self.value_clip <= 0:
            _fail(f"{p}.value_clip={self.value_clip} must be > 0 or null")
        for name in ("vf_coef", "entropy_coef", "ptx_coef"):
            if getattr(self, name) < 0:
                _fail(f"{p}.{name}={getattr(self, name)} must be >= 0")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            _fail(f"{p}.gamma={self.gamma} and {p}.lam={self.lam} must be in [0, 1]")
        if (why := gamma_error(self.gamma, self.advantage, p)) is not None:
            _fail(why)
        if not (self.is_cap >= 1 and math.isfinite(self.is_cap)):
            _fail(f"{p}.is_cap={self.is_cap} must be a finite number >= 1 (weights above it are capped)")
        for why in (band_error(self.off_policy, self.rs_lower, self.rs_upper, p),
                    policy_loss_error(self.policy_loss, self.agg, self.dual_clip, p)):
            if why is not None:
                _fail(why)


@config_class
class TrainerConfig:
    """What the learner pool itself declares: the DeepSpeed engine, the critic, the transport."""
    zero_stage: int = setting(2, "DeepSpeed ZeRO stage 0-3 (3 shards parameters too)")
    dtype: Optional[TrainableDType] = setting(None, "float32 | bfloat16 (bf16 keeps fp32 master weights); "
                                                    "null = model.dtype")
    optim: OptimConfig
    lora: LoraConfig
    critic: Optional[Critic] = setting(None, "shared: value head on the policy body | separate: own body | none: "
                                             "no value model; null = shared with ppo.advantage=gae, none with "
                                             "the critic-free estimators")
    critic_model: Optional[str] = setting(None, "with critic=separate: a sequence-classification checkpoint "
                                                "(reward model)")
    dist_timeout_s: float = setting(600.0, "collectives waiting longer than this fail instead of hanging")
    gradient_checkpointing: bool = setting(False, "trade compute for activation memory")
    weight_sync: WeightSync = setting("cpu", "cpu: safetensors buckets via Ray | nccl: GPU broadcast to generators "
                                             "on other GPUs | ipc: CUDA IPC to generators on learner rank 0's GPU "
                                             "(one GPU shared; learner.replicas=1)")

    def validate(self, world_size: int = 1) -> None:
        p = "learner"
        if world_size < 1:
            _fail(f"{p}: world_size={world_size} must be >= 1")
        if self.zero_stage not in (0, 1, 2, 3):
            _fail(f"{p}.zero_stage={self.zero_stage} is out of range; use 0, 1, 2 or 3")
        check_choices(self, p)
        if self.critic == "separate" and not self.critic_model:
            _fail(f"{p}.critic_model is required with critic='separate'; point it at a reward-model checkpoint")
        if self.dist_timeout_s <= 0:
            _fail(f"{p}.dist_timeout_s={self.dist_timeout_s} must be > 0")
        if TRANSPORTS[self.weight_sync].one_learner_rank and world_size > 1:
            _fail(f"{p}.weight_sync='ipc' shares learner rank 0's GPU with the generators and needs "
                  f"{p}.replicas=1 (got {world_size}); use weight_sync='nccl' for more ranks")
        self.optim.validate(world_size)
        self.lora.validate(world_size)
        self.lora.check_critic(self.critic)


@config_class
class RankConfig(TrainerConfig):
    """What a learner rank builds its engine from: the trainer settings and the batch sizes of
    what it trains (LearnerConfig for PPO, SupervisedConfig for the stages before it)."""

    def check_device(self, has_cuda: bool) -> None:
        """Checks that depend on the rank's hardware. Called by each LearnerWorker, not by
        ``validate``: the driver that validates a config may well have no GPU itself."""
        needs = TRANSPORTS[self.weight_sync].learner_cuda
        if needs and not has_cuda:
            _fail(f"learner.weight_sync={self.weight_sync!r} needs CUDA on the learner "
                  f"({needs}); this rank has no GPU: set learner.weight_sync='cpu' "
                  "or give the learner num_gpus")

    def batch_sizes(self) -> tuple[int, int]:
        """(items per optimizer step over all ranks, items per forward on one rank)."""
        raise NotImplementedError

    def deepspeed_config(self, world_size: int, trainable: int | None = None) -> dict:
        """The DeepSpeed config dict; batch sizes mirror batch_sizes() (DeepSpeed checks their product).
        trainable: the module's trainable parameter count, which caps the gradient bucket."""
        batch, micro = self.batch_sizes()
        bf16 = self.dtype == "bfloat16"
        # Gradients accumulate over micro-batches in fp32 (bf16 sums lose ~0.4% of the minibatch
        # gradient). DeepSpeed does that only behind an optimizer wrapper: without ZeRO, bf16 with
        # fp32 accumulation is its stage-1 BF16_Optimizer (fp32 master weights split over the
        # ranks; the same numbers as unpartitioned, less memory).
        stage = 1 if bf16 and self.zero_stage == 0 else self.zero_stage
        return {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": batch // (world_size * micro),
            "train_batch_size": batch,
            "gradient_clipping": self.optim.grad_clip,
            # overlap_comm needs streams; nothing to overlap with on CPU and simpler to reason about.
            "zero_optimization": {"stage": stage, "overlap_comm": False,
                                  "reduce_bucket_size": reduce_bucket_size(trainable)},
            "bf16": {"enabled": bf16},
            "data_types": {"grad_accum_dtype": "fp32"},
            "zero_allow_untested_optimizer": True,  # plain torch AdamW / SGD under ZeRO
            "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }


# DeepSpeed's default gradient bucket, in elements.
DEEPSPEED_REDUCE_BUCKET = 500_000_000


def reduce_bucket_size(trainable: int | None) -> int:
    """Elements per gradient bucket: DeepSpeed's default, or the trainable count where that is
    smaller. ZeRO-3 allocates one bucket per gradient dtype up front (2 GB each in fp32 at the
    default), which a model of fewer parameters never fills; the sums do not depend on it."""
    if not trainable:
        return DEEPSPEED_REDUCE_BUCKET
    return max(1, min(DEEPSPEED_REDUCE_BUCKET, int(trainable)))


@config_class
class SupervisedConfig(RankConfig):
    """Everything a LearnerWorker training an SFT model or a reward model needs: the trainer
    settings plus the stage's own batch sizes and seed (filled in by the stage's config,
    cluster.config.stages.StageConfig.learner_config())."""
    batch_size: int = setting(8, "rows per optimizer step, over all learner ranks")
    micro_batch_size: int = setting(4, "rows per forward/backward on one rank (gradient accumulation)")
    packing: bool = setting(True, "each micro-batch as one row of its real tokens, no padding, attended per "
                                  "sequence")
    seed: int = setting(0, "seeds the score-head init")

    def validate(self, world_size: int = 1) -> None:
        super().validate(world_size)
        if min(self.batch_size, self.micro_batch_size) < 1:
            _fail("learner: batch_size and micro_batch_size must be >= 1")
        if self.batch_size % (world_size * self.micro_batch_size):
            _fail(f"learner: batch_size={self.batch_size} is not divisible by world_size*micro_batch_size="
                  f"{world_size}*{self.micro_batch_size}")

    def batch_sizes(self) -> tuple[int, int]:
        return self.batch_size, self.micro_batch_size


@config_class
class LearnerConfig(RankConfig):
    """Everything a LearnerWorker needs: the trainer settings plus the PPO update and
    values owned by other sections of a run's config (the run seed, the sampling
    temperature and truncation), filled in by cluster.config.ppo.TetherConfig.learner_config()."""
    ppo: PPOConfig
    seed: int = setting(0, "seeds minibatch shuffling and value-head init")
    temperature: float = setting(1.0, "the sampling temperature: logits are divided by it (as in vLLM)")
    top_k: int = setting(0, "the sampling top-k: the learner scores the distribution the generator sampled "
                            "from (core.sampling)")
    top_p: float = setting(1.0, "the sampling top-p, as top_k")
    max_new_tokens: Optional[int] = setting(
        None, "the generation budget (generator.sampling.max_new_tokens): ppo.agg=seq-mean-token-sum-norm divides "
              "each sequence's token sum by it, a constant as in Dr. GRPO")
    reference_threads: int = setting(0, "reference.on_learner: CPU threads rank 0 scores the reference with "
                                        "(the scorers' share of the node); 0: the learner's own")
    teacher_coef: float = setting(0.0, "teacher.coef: the weight of the teacher's reverse-KL term in each token's "
                                       "advantage (core/distill.py); 0 = the run has no teacher")

    def validate(self, world_size: int = 1, *, ppo_at: str = "learner.ppo") -> None:
        super().validate(world_size)
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            _fail(f"learner.temperature={self.temperature} must be a finite number > 0 (the sampling temperature)")
        if self.top_k < 0 or not 0 < self.top_p <= 1:
            _fail(f"learner.top_k={self.top_k} must be >= 0 and learner.top_p={self.top_p} in (0, 1] "
                  "(the sampling truncation)")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            _fail(f"learner.max_new_tokens={self.max_new_tokens} must be >= 1 (the generation budget)")
        if self.ppo.agg == "seq-mean-token-sum-norm" and self.max_new_tokens is None:
            _fail("learner: ppo.agg=seq-mean-token-sum-norm divides by the generation budget; set "
                  "learner max_new_tokens (a job sets it from generator.sampling.max_new_tokens)")
        self.ppo.validate(world_size, at=ppo_at)
        self._check_critic()
        if self.lora.enabled and self.lora.dropout:
            _fail(f"learner.lora.dropout={self.lora.dropout}: PPO's ratios need the learner to score tokens as the "
                  "sampler did, without dropout noise; set learner.lora.dropout=0")

    def batch_sizes(self) -> tuple[int, int]:
        return self.ppo.minibatch_size, self.ppo.micro_batch_size

    @property
    def value_model(self) -> Critic:
        """The critic this run trains: ``critic``, or what ``ppo.advantage`` implies when null."""
        if self.critic is not None:
            return self.critic
        return "shared" if estimator_row(self.ppo.advantage).needs_critic else "none"

    def _check_critic(self) -> None:
        name = self.ppo.advantage
        needs_critic = estimator_row(name).needs_critic
        if not needs_critic and self.critic in ("shared", "separate"):
            _fail(f"learner.critic={self.critic} trains a value model that ppo.advantage={name} never reads; "
                  "set learner.critic=none (or leave it null)")
        if needs_critic and self.critic == "none":
            _fail(f"learner.critic=none leaves ppo.advantage={name} without values; use critic shared or "
                  f"separate, or a critic-free estimator ({critic_free_names()})")

    @classmethod
    def from_dict(cls, data: dict | None) -> "LearnerConfig":
        data = dict(data or {})
        world_size = data.pop("world_size", 1)
        optim = dict(data.pop("optim", {}) or {})
        if "betas" in optim:
            optim["betas"] = tuple(optim["betas"])
        optim = _from_dict(OptimConfig, optim, "learner.optim")
        lora = _from_dict(LoraConfig, dict(data.pop("lora", {}) or {}), "learner.lora")
        ppo = _from_dict(PPOConfig, dict(data.pop("ppo", {}) or {}), "learner.ppo")
        cfg = _from_dict(cls, {**data, "optim": optim, "lora": lora, "ppo": ppo}, "learner")
        cfg.validate(world_size)
        return cfg

    def to_dict(self) -> dict:
        return asdict(self)

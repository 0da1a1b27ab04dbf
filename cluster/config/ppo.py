"""The PPO job's typed config (python -m cluster.train): its sections, the root TetherConfig and the
cross-field checks that no single section can make.

    python -m cluster.train --config configs/tiny-cpu.yaml ppo.kl.beta=0.02 run.steps=5

Every section is a frozen config class whose keys carry their help as field metadata
(`python -m cluster.train --help-config`, docs/config.md). Each setting is declared once:
the learner's and PPO's own classes (learner/config.py) and the generator's
(core/modeling/engine_config.py) are the sections here, not copies of them. Loading (cluster/config/loader.py)
checks unknown keys, types and choices; ``validate`` then checks impossible combinations
before anything starts, and fails with one line naming the key and the fix.
"""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Optional

from actors.environments.config import EnvConfig, check_env
from actors.rewards.config import RewardConfig, check_reward_http, check_sandbox
from actors.rewards.source import given_sources, one_source_rule
from cluster.config import loader
from cluster.config.ineffective import check_ineffective
from cluster.config.loader import ConfigError, RootConfig
from cluster.config.pools import check_pools
from cluster.config.reward_sources import check_reward_sources
from cluster.config.step import check_step
from cluster.config.teacher import TeacherConfig, check_teacher
from cluster.config.tracking import TRACKERS_HELP, TrackingConfig, tracker_names
from core.choices import CPUThreads, KLEstimator, KLPlacement, PlacementStrategy, Precision, RunMode, kl_placement_error
from core.infra.dtypes import resolve_precision
from core.infra.schema import config_class, setting
from core.modeling.engine_config import EngineConfig, SamplingConfig
from learner.config import LearnerConfig, PPOConfig, TrainerConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"  # the shipped configs
DEFAULT_CONFIG = CONFIGS / "tiny-cpu.yaml"
BUILTIN_POLICY = "builtin:tiny"        # the offline tiny model, pre-trained on the built-in corpus
BUILTIN_POLICY_30M = "builtin:tiny-30m"
BUILTIN_POLICY_POSITIVE = "builtin:tiny-positive"  # builtin:tiny's recipe on the corpus's positive sentences


@config_class
class ModelConfig:
    """The policy PPO trains (and starts the reference from)."""
    policy: str = setting(BUILTIN_POLICY, "HF model directory, builtin:tiny, builtin:tiny-positive (the same "
                                          "recipe on the corpus's positive sentences only: a teacher to distil), "
                                          "builtin:tiny-30m (random init, for benchmarks), or builtin:arith (the "
                                          "arithmetic task's)")
    tokenizer: Optional[str] = setting(None, "defaults to the policy directory")
    dtype: Precision = setting("auto", "the whole service's precision: the generators, reference, reward model and "
                                       "learner (bf16 keeps fp32 master weights). auto: bfloat16 on GPUs and on "
                                       "CPUs with native bf16 (AMX-BF16 or AVX512-BF16), else float32")


@config_class
class PoolConfig:
    """A pool of actors and the resources each replica reserves."""
    replicas: int = setting(1, "actors in this pool")
    num_cpus: float = setting(1.0, "CPUs reserved per replica")
    num_gpus: float = setting(0.0, "GPUs reserved per replica")
    node_labels: Optional[str] = setting(None, "place this pool's replicas only on Ray nodes carrying these labels: "
                                               "'key=value[,key=value]' (as `ray start --labels`); null = any node")
    strategy: PlacementStrategy = setting("pack", "pack: replicas fill as few nodes as possible (Ray's PACK) | "
                                                  "spread: each new replica goes to the matching node holding the "
                                                  "fewest of this pool's replicas (else any matching node with room)")


@config_class
class GeneratorPoolConfig(PoolConfig):
    """The generators: vLLM engines sampling rollouts from the current policy."""
    tensor_parallel: int = setting(1, "GPUs one vLLM engine spans (bundled STRICT_PACK)")
    partial_rollouts: bool = setting(True, "async mode: a weight push lands between engine steps, not after a "
                                           "whole generate call; in-flight requests go on under the new weights, "
                                           "each token keeps the version that sampled it (sync mode: no effect)")
    sampling: SamplingConfig
    engine: EngineConfig


@config_class
class ReferencePoolConfig(PoolConfig):
    """The reference: the frozen model of the KL penalty."""
    batch_size: int = setting(16, "sequences per forward pass")
    packing: bool = setting(True, "each forward's sequences as one row of their real tokens, no padding, "
                                  "attended per sequence")
    model: Optional[str] = setting(None, "the frozen model of the KL penalty; null = the policy the run "
                                         "starts from (the SFT model)")
    on_learner: bool = setting(False, "with learner.lora: learner rank 0 scores the reference, the policy with its "
                                      "adapter off; no reference pool (its replicas and memory are saved)")

    @property
    def pool_replicas(self) -> int:
        """The reference pool's replicas: none when the learner scores the reference."""
        return 0 if self.on_learner else self.replicas


@config_class
class RewardPoolConfig(RewardConfig, PoolConfig):
    """The reward: a reward model, a Python function, a server over HTTP or a judge model scoring each response."""

    def scoring(self) -> RewardConfig:
        """This section without the pool's resources: what a reward replica is built from."""
        return RewardConfig(**{f.name: getattr(self, f.name) for f in fields(RewardConfig)})


@config_class
class BufferConfig:
    """The rollout buffer between the generators and the learner."""
    capacity: int = setting(1024, "rollouts held; producers block when full (backpressure)")
    max_staleness: int = setting(1, "async mode: drop rollouts older than this many versions")
    timeout_s: float = setting(600.0, "a step waiting this long for rollouts (or a producer for room) fails")
    node_labels: Optional[str] = setting(None, "place the buffer only on a Ray node carrying these labels: "
                                               "'key=value[,key=value]'; null = any node")


@config_class
class LearnerPoolConfig(PoolConfig, TrainerConfig):
    """The learner pool: its resources plus the trainer's own settings (learner/config.py)."""


@config_class
class KLConfig:
    """The KL penalty to the reference."""
    beta: float = setting(0.05, "initial weight of the per-token KL penalty")
    estimator: KLEstimator = setting("k1", "k1 | k2 | k3 (Schulman): k1 in the reward; k3 (or k2) in the loss")
    placement: KLPlacement = setting("reward", "reward: -beta x KL per token in the reward (classic RLHF) | "
                                               "loss: beta x KL as a loss term with its gradient (GRPO family)")
    target: Optional[float] = setting(None, "set to use the adaptive controller (Ziegler et al.); "
                                            "null = fixed beta")
    horizon: int = setting(10000, "adaptive controller horizon, in rollouts")


@config_class
class PPOSection(PPOConfig):
    """The PPO update (learner/config.py), the KL penalty and the reward shaping."""
    kl: KLConfig
    truncation_penalty: float = setting(0.0, "added to the score of responses cut at max_new_tokens (use < 0)")
    reward_clip: Optional[float] = setting(None, "clip scores to +-this before they enter the reward")
    filter_groups: bool = setting(False, "dynamic sampling (DAPO): leave out prompts whose samples all scored the "
                                         "same and draw more prompt batches until the step has its rollouts; "
                                         "it trains on one batch of them (sync mode)")
    filter_max_batches: int = setting(3, "with filter_groups: prompt batches one step may draw at most, the first "
                                         "included (the cap on extra generation)")


@config_class
class DataConfig:
    """The prompts: where they come from and how many a step samples."""
    path: Optional[str] = setting(None, ".jsonl / .parquet / saved HF dataset folder, or a Hugging Face Hub dataset "
                                        "id owner/name (read through the datasets cache; a local path of that "
                                        "name wins), or builtin:arith (the arithmetic task's rows); null = "
                                        "built-in prompts")
    split: str = setting("train", "the split of a Hub dataset or saved DatasetDict (datasets' syntax: "
                                  "train, test, train[:1000])")
    config_name: Optional[str] = setting(None, "the config of a Hub dataset that has several (openai/gsm8k: main)")
    field: str = setting("prompt", "the prompt column: strings, or chats (lists of role/content messages, "
                                   "always rendered by the tokenizer's chat template)")
    columns: Optional[tuple[str, ...]] = setting(None, "the row's other fields passed to the reward as keyword "
                                                       "arguments (null = all)")
    source_field: str = setting("source", "the field that names a row's source: reward/<source>/mean per step")
    chat_template: bool = setting(False, "wrap string prompts in the tokenizer's chat template, as the user turn")
    system_prompt: Optional[str] = setting(None, "with chat_template: a system message before each prompt (a chat "
                                                 "with a system message of its own keeps that)")
    max_prompt_tokens: Optional[int] = setting(None, "longer prompts are skipped and counted")
    prompts_per_step: int = setting(16, "prompts sampled per PPO step (x generator.sampling.n rollouts)")
    eval_prompts: int = setting(16, "held out for periodic evaluation")
    seed: int = setting(0, "shuffling seed")


@config_class
class PTXConfig:
    """Pretraining text for the PTX loss, used when ppo.ptx_coef > 0 (cluster/data/ptx.py)."""
    path: Optional[str] = setting(None, ".jsonl / .parquet / saved HF dataset of text, or a Hub dataset id "
                                        "owner/name; null = built-in corpus (built-in policy only)")
    split: str = setting("train", "the split of a Hub dataset or saved DatasetDict")
    config_name: Optional[str] = setting(None, "the config of a Hub dataset that has several")
    field: str = setting("text", "the text column")
    seq_len: Optional[int] = setting(None, "tokens per packed row; null = generator.engine.max_model_len")
    batch_size: int = setting(8, "PTX rows per optimizer step, over all learner ranks")

    def tokens_per_row(self, max_model_len: int) -> int:
        return self.seq_len if self.seq_len is not None else max_model_len


@config_class
class RunConfig:
    """The run: steps, mode, its folder, evaluation, checkpoints and logs."""
    steps: int = setting(20, "PPO steps (policy versions) to train")
    mode: RunMode = setting("sync", "sync (on-policy) | async (bounded staleness)")
    dir: str = setting("runs", "run folders are created under this directory")
    name: Optional[str] = setting(None, "run folder name; default: timestamp")
    eval_every: int = setting(5, "steps between evaluations (0 = only at start and end)")
    save_every: int = setting(0, "steps between HF checkpoints (0 = only the final one)")
    checkpoint_every: int = setting(5, "steps between resumable checkpoints (learner + driver state; 0 = none)")
    keep_checkpoints: int = setting(2, "resumable checkpoints kept; older ones are pruned")
    resume: Optional[str] = setting(None, 'a run folder to continue, or "auto" (the latest resumable run '
                                          "named run.name)")
    samples_every: int = setting(5, "steps between samples.jsonl dumps")
    plot_every: int = setting(1, "steps between redraws of plots/*.png (0 = no plots)")
    tensorboard: bool = setting(False, "alias: adds tensorboard to run.trackers (event files in tensorboard/)")
    trackers: tuple[str, ...] = setting((), TRACKERS_HELP)
    tracking: TrackingConfig
    library_logs: bool = setting(False, "show vLLM / Hugging Face / DeepSpeed console logs "
                                        "(off: tether's own lines only)")
    alarm_window: int = setting(10, "steps the over-optimisation alarms look back over "
                                    "(cluster/runtime/observe/alarms.py); 0 = off")
    seed: int = setting(0, "seeds the learner (minibatch shuffling, value-head init) and the PTX rows")

    def tracker_names(self) -> tuple[str, ...]:
        return tracker_names(self.trackers, self.tensorboard)


@config_class
class ResourcesConfig:
    """The Ray cluster the job runs on."""
    address: Optional[str] = setting(None, "Ray cluster to join; null = RAY_ADDRESS / the job's cluster / local")
    num_cpus: Optional[int] = setting(None, "CPUs of a local cluster started by the entrypoint")
    placement_timeout_s: float = setting(60.0, "how long a pool waits for resources before failing")
    cpu_threads: CPUThreads = setting("phase", "phase: in sync mode the running phase's actors share the node's "
                                               "cores | reserved: num_cpus each (cluster/runtime/pools/threads.py)")


# The pools a running job can resize (the learner's world size is fixed for a run).
SCALABLE_POOLS = ("generator", "reference", "reward")


@config_class
class TetherConfig(RootConfig):
    """The PPO job: its actor pools, the rollout buffer, the PPO update, the prompts and the run."""
    model: ModelConfig
    generator: GeneratorPoolConfig
    reference: ReferencePoolConfig
    reward: RewardPoolConfig
    teacher: TeacherConfig
    buffer: BufferConfig
    learner: LearnerPoolConfig
    ppo: PPOSection
    data: DataConfig
    ptx: PTXConfig
    env: EnvConfig
    run: RunConfig
    resources: ResourcesConfig

    def learner_config(self) -> LearnerConfig:
        """What a learner rank needs: the learner section, the PPO update, the run seed, the
        sampling temperature and truncation (the learner scores the distribution sampled from)
        and the generation budget (seq-mean-token-sum-norm's divisor)."""
        pick = lambda obj, cls: {f.name: getattr(obj, f.name) for f in fields(cls)}
        trainer = {**pick(self.learner, TrainerConfig), "dtype": self.precision()["learner"][0]}
        return LearnerConfig(**trainer, ppo=PPOConfig(**pick(self.ppo, PPOConfig)),
                             seed=self.run.seed, temperature=self.generator.sampling.temperature,
                             top_k=self.generator.sampling.top_k, top_p=self.generator.sampling.top_p,
                             max_new_tokens=self.env.max_tokens if self.env.enabled else
                             self.generator.sampling.max_new_tokens,
                             teacher_coef=self.teacher.coef if self.teacher.enabled else 0.0)

    @property
    def rollouts_per_step(self) -> int:
        """One step's batch: data.prompts_per_step prompts x generator.sampling.n samples each."""
        return self.data.prompts_per_step * self.generator.sampling.n

    def precision(self) -> dict[str, tuple[str, str]]:
        """role -> (dtype, why): the role's own setting (generator.engine.dtype, learner.dtype)
        else model.dtype, ``auto`` resolved for the role's device (a GPU when its pool reserves
        one, else a CPU like the driver's; core/infra/dtypes.py)."""
        own = {"generator": self.generator.engine.dtype, "learner": self.learner.dtype}
        out = {}
        for role in ("generator", "reference", "reward", "learner"):
            setting = own.get(role) or self.model.dtype
            out[role] = resolve_precision(setting, on_gpu=getattr(self, role).num_gpus > 0)
        return out

    def validate(self) -> None:
        validate(self)


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TetherConfig:
    return loader.load(TetherConfig, path, overrides)


def describe(root=None) -> str:
    """Every key with its default and help, for --help-config (of ``root``; default the PPO job)."""
    return loader.describe(root or TetherConfig)


def validate(cfg: TetherConfig) -> None:
    """Cross-field checks: what each section alone cannot see."""
    check_pools(cfg)
    check_reward_sources(cfg)  # reward.sources and group judges, before the one-source rule counts them
    _check_reward(cfg.reward, teacher=cfg.teacher.enabled)
    if cfg.ppo.old_logprobs == "behaviour" and cfg.run.mode != "sync":
        raise ConfigError("config: ppo.old_logprobs=behaviour takes the sampler's log-probs as the update's "
                          "starting policy, which holds in sync mode only; set run.mode=sync or "
                          "ppo.old_logprobs=recompute")
    _check_run(cfg.run)
    if cfg.buffer.max_staleness < 0 or cfg.buffer.capacity < 1 or cfg.buffer.timeout_s <= 0:
        raise ConfigError("config: buffer.max_staleness must be >= 0, buffer.capacity >= 1 and "
                          "buffer.timeout_s > 0")
    _check_data(cfg.data)
    _check_kl(cfg.ppo.kl)
    check_step(cfg)
    try:
        cfg.learner_config().validate(world_size=cfg.learner.replicas, ppo_at="ppo")
        cfg.learner.lora.engine_rank(cfg.generator.engine.max_lora_rank)  # the engines serve the adapter
    except ValueError as e:
        raise ConfigError(f"config: {e}") from None
    _check_ptx(cfg)
    check_env(cfg.env)
    check_teacher(cfg)
    if cfg.env.agent and cfg.data.chat_template:
        raise ConfigError("config: env.agent gets each prompt's text and writes its own messages; with "
                          "data.chat_template=true it would get the template's rendering: set data.chat_template=false")
    check_ineffective(cfg)
    # Every learner rank trains on whole prompt groups (core.rollout.shard_rollouts): one at least.
    if cfg.data.prompts_per_step < cfg.learner.replicas:
        raise ConfigError(f"config: data.prompts_per_step={cfg.data.prompts_per_step} is below "
                          f"learner.replicas={cfg.learner.replicas}: each learner rank trains on whole prompts; "
                          f"raise prompts_per_step to at least {cfg.learner.replicas}")


def _check_reward(reward: RewardPoolConfig, *, teacher: bool) -> None:
    """``teacher``: the run has one, so no reward source at all is pure distillation."""
    if len(given_sources(reward)) != 1 and not (teacher and not given_sources(reward)):
        raise ConfigError(f"config: {one_source_rule()} (the others to null)")
    check_reward_http(reward.url, reward.http)
    if reward.normalize and reward.model is None:
        raise ConfigError("config: reward.normalize standardises reward-model scores; set reward.model "
                          "(a reward-model checkpoint with reward_stats.json) or reward.normalize=false")
    if not 0 <= reward.max_invalid_fraction <= 1:
        raise ConfigError(f"config: reward.max_invalid_fraction={reward.max_invalid_fraction} must be in [0, 1] "
                          "(the share of a step's scores that may be invalid)")
    check_sandbox(reward.sandbox)
    if not reward.timeout_s > 0:
        raise ConfigError(f"config: reward.timeout_s={reward.timeout_s} must be > 0 (seconds a reward function "
                          "call may take)")


def _check_run(run: RunConfig) -> None:
    if min(run.plot_every, run.eval_every, run.save_every, run.samples_every, run.alarm_window) < 0:
        raise ConfigError("config: run.plot_every/eval_every/save_every/samples_every/alarm_window must be >= 0")
    if run.checkpoint_every < 0 or run.keep_checkpoints < 1:
        raise ConfigError("config: run.checkpoint_every must be >= 0 and run.keep_checkpoints >= 1")
    if run.steps < 1:
        raise ConfigError(f"config: run.steps={run.steps} must be >= 1")
    check_run_name(run.name)


def _check_data(data: DataConfig) -> None:
    if data.prompts_per_step < 1:
        raise ConfigError(f"config: data.prompts_per_step={data.prompts_per_step} must be >= 1")
    if data.eval_prompts < 0:
        raise ConfigError(f"config: data.eval_prompts={data.eval_prompts} must be >= 0 (0 = no evaluation set)")
    if data.max_prompt_tokens is not None and data.max_prompt_tokens < 1:
        raise ConfigError(f"config: data.max_prompt_tokens={data.max_prompt_tokens} must be >= 1, "
                          "or null to keep prompts of any length")
    if not data.split.strip():
        raise ConfigError(f"config: data.split={data.split!r} must name a split (default train)")
    if data.system_prompt is not None and not data.chat_template:
        raise ConfigError("config: data.system_prompt goes into the chat template; set data.chat_template=true")
    if data.config_name is not None and not data.config_name.strip():
        raise ConfigError(f"config: data.config_name={data.config_name!r} must name a config, or be null")
    if data.path is None and (data.split != "train" or data.config_name is not None):
        raise ConfigError("config: data.split / data.config_name choose part of data.path, which is null (the "
                          "built-in prompts); set data.path to a Hub dataset id, or remove them")


def _check_kl(kl: KLConfig) -> None:
    kl_problem = kl_placement_error(kl.placement, kl.estimator)
    if kl_problem:
        raise ConfigError(f"config: {kl_problem}")
    if kl.beta < 0:
        raise ConfigError(f"config: ppo.kl.beta={kl.beta} must be >= 0 (0 = no KL penalty)")
    if kl.target is not None and kl.target <= 0:
        raise ConfigError(f"config: ppo.kl.target={kl.target} must be > 0, or null for a fixed beta")


def _check_ptx(cfg: TetherConfig) -> None:
    p = cfg.ptx
    if p.seq_len is not None and p.seq_len < 2:
        raise ConfigError(f"config: ptx.seq_len={p.seq_len} must be >= 2, or null for generator.engine.max_model_len")
    if cfg.ppo.ptx_coef > 0 and (p.batch_size < 1 or p.batch_size % cfg.learner.replicas):
        raise ConfigError(f"config: ptx.batch_size={p.batch_size} must be a positive multiple of "
                          f"learner.replicas={cfg.learner.replicas} (every rank trains on an equal share)")


def check_run_name(name: Optional[str]) -> None:
    """run.name is one folder under run.dir: a path in it would write the run elsewhere."""
    if name is None:
        return
    if "/" in name or "\\" in name or name in (".", ".."):
        raise ConfigError(f"config: run.name={name!r} must be a plain folder name (no '/', '\\' or '..'); "
                          "put the parent directory in run.dir")

"""One typed config for a tether run: YAML file + dotted command-line overrides.

    python -m cluster.train --config configs/tiny-cpu.yaml ppo.kl.beta=0.02 run.steps=5

Every section is a frozen dataclass; the comment beside each field is its documentation
(`python -m cluster.train --help-config` prints them). Each setting is declared once:
the learner's and PPO's own classes (learner/config.py) and the generator's
(actors/generator.py) are the sections here, not copies of them. Loading checks unknown keys
(suggesting the nearest valid name), types and impossible combinations before
anything starts, and fails with one line naming the key and the fix.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Optional

import yaml

from actors.config import EngineConfig, SamplingConfig
from core.choices import kl_placement_error
from learner.config import LearnerConfig, PPOConfig, TrainerConfig

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.yaml"
BUILTIN_POLICY = "builtin:tiny"        # the offline tiny model, pre-trained on the built-in corpus
BUILTIN_POLICY_30M = "builtin:tiny-30m"
BUILTIN_REWARD = "cluster.demo.sentiment:sentiment"


class ConfigError(ValueError):
    """A user mistake in the config: the message is one line naming the key and the fix."""


@dataclass(frozen=True)
class ModelConfig:
    policy: str = BUILTIN_POLICY     # HF model directory, builtin:tiny, or builtin:tiny-30m (random init, for benchmarks)
    tokenizer: Optional[str] = None  # defaults to the policy directory


@dataclass(frozen=True)
class PoolConfig:
    replicas: int = 1                # actors in this pool
    num_cpus: float = 1.0            # CPUs reserved per replica
    num_gpus: float = 0.0            # GPUs reserved per replica


@dataclass(frozen=True)
class GeneratorPoolConfig(PoolConfig):
    tensor_parallel: int = 1         # GPUs one vLLM engine spans (bundled STRICT_PACK)
    partial_rollouts: bool = True    # async mode: a weight push lands between engine steps, not after a whole
                                     # generate call; in-flight requests go on under the new weights, each
                                     # token keeps the version that sampled it (sync mode: no effect)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)


@dataclass(frozen=True)
class ReferencePoolConfig(PoolConfig):
    batch_size: int = 16             # sequences per forward pass
    model: Optional[str] = None      # the frozen model of the KL penalty; null = the policy the run starts from (the SFT model)


@dataclass(frozen=True)
class RewardPoolConfig(PoolConfig):
    model: Optional[str] = None      # sequence-classification reward model directory, or ...
    function: Optional[str] = BUILTIN_REWARD  # ... a `module:function(prompts, responses) -> floats`
    batch_size: int = 16
    normalize: bool = False          # standardise reward-model scores with the reward_stats.json beside reward.model
    gold: Optional[str] = None       # eval only: a `module:function(prompts, responses) -> floats` scored on the
                                     # held-out prompts as eval/gold_score, never trained on (the true goal behind a proxy)
    max_invalid_fraction: float = 0.5  # a step whose share of invalid scores (NaN/inf, or the reward raised) is above this stops the run, naming the reward; 1 = never


@dataclass(frozen=True)
class BufferConfig:
    capacity: int = 1024             # rollouts held; producers block when full (backpressure)
    max_staleness: int = 1           # async mode: drop rollouts older than this many versions
    timeout_s: float = 600.0         # a step waiting this long for rollouts (or a producer for room) fails


@dataclass(frozen=True)
class LearnerPoolConfig(PoolConfig, TrainerConfig):
    """The learner pool: its resources plus the trainer's own settings (learner/config.py)."""


@dataclass(frozen=True)
class KLConfig:
    beta: float = 0.05               # initial weight of the per-token KL penalty
    estimator: str = "k1"            # k1 | k2 | k3 (Schulman): k1 in the reward; k3 (or k2) in the loss
    placement: str = "reward"        # reward: -beta x KL per token in the reward (classic RLHF) | loss: beta x KL as a loss term with its gradient (GRPO family)
    target: Optional[float] = None   # set to use the adaptive controller (Ziegler et al.); null = fixed beta
    horizon: int = 10000             # adaptive controller horizon, in rollouts


@dataclass(frozen=True)
class PPOSection(PPOConfig):
    kl: KLConfig = field(default_factory=KLConfig)
    truncation_penalty: float = 0.0  # added to the score of responses cut at max_new_tokens (use < 0)
    reward_clip: Optional[float] = None  # clip scores to +-this before they enter the reward


@dataclass(frozen=True)
class DataConfig:
    path: Optional[str] = None       # .jsonl / .parquet / saved HF dataset; null = built-in prompts
    field: str = "prompt"            # the prompt column
    chat_template: bool = False      # wrap prompts in the tokenizer's chat template
    max_prompt_tokens: Optional[int] = None  # longer prompts are skipped and counted
    prompts_per_step: int = 16       # prompts sampled per PPO step (x generator.sampling.n rollouts)
    eval_prompts: int = 16           # held out for periodic evaluation
    seed: int = 0                    # shuffling seed


@dataclass(frozen=True)
class PTXConfig:
    """Pretraining text for the PTX loss, used when ppo.ptx_coef > 0 (cluster/data/ptx.py)."""
    path: Optional[str] = None       # .jsonl / .parquet / saved HF dataset of text; null = built-in corpus (built-in policy only)
    field: str = "text"              # the text column
    seq_len: Optional[int] = None    # tokens per packed row; null = generator.engine.max_model_len
    batch_size: int = 8              # PTX rows per optimizer step, over all learner ranks

    def tokens_per_row(self, max_model_len: int) -> int:
        return self.seq_len if self.seq_len is not None else max_model_len


@dataclass(frozen=True)
class RunConfig:
    steps: int = 20                  # PPO steps (policy versions) to train
    mode: str = "sync"               # sync (on-policy) | async (bounded staleness)
    dir: str = "runs"                # run folders are created under this directory
    name: Optional[str] = None       # run folder name; default: timestamp
    eval_every: int = 5              # steps between evaluations (0 = only at start and end)
    save_every: int = 0              # steps between HF checkpoints (0 = only the final one)
    checkpoint_every: int = 5        # steps between resumable checkpoints (learner + driver state; 0 = none)
    keep_checkpoints: int = 2        # resumable checkpoints kept; older ones are pruned
    resume: Optional[str] = None     # a run folder to continue, or "auto" (the latest resumable run named run.name)
    samples_every: int = 5           # steps between samples.jsonl dumps
    plot_every: int = 1              # steps between redraws of plots/*.png (0 = no plots)
    tensorboard: bool = False        # also write TensorBoard event files (pip install tensorboard)
    library_logs: bool = False       # show vLLM / Hugging Face / DeepSpeed console logs (off: tether's own lines only)
    alarm_window: int = 10           # steps the over-optimisation alarms look back over (cluster/runtime/alarms.py); 0 = off
    seed: int = 0


@dataclass(frozen=True)
class ResourcesConfig:
    address: Optional[str] = None    # Ray cluster to join; null = RAY_ADDRESS / the job's cluster / local
    num_cpus: Optional[int] = None   # CPUs of a local cluster started by the entrypoint
    placement_timeout_s: float = 60.0  # how long a pool waits for resources before failing
    cpu_threads: str = "phase"       # phase: in sync mode the running phase's actors share the node's cores; reserved: num_cpus each (cluster/runtime/threads.py)


@dataclass(frozen=True)
class TetherConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    generator: GeneratorPoolConfig = field(default_factory=GeneratorPoolConfig)
    reference: ReferencePoolConfig = field(default_factory=ReferencePoolConfig)
    reward: RewardPoolConfig = field(default_factory=RewardPoolConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    learner: LearnerPoolConfig = field(default_factory=LearnerPoolConfig)
    ppo: PPOSection = field(default_factory=PPOSection)
    data: DataConfig = field(default_factory=DataConfig)
    ptx: PTXConfig = field(default_factory=PTXConfig)
    run: RunConfig = field(default_factory=RunConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)

    def learner_config(self) -> LearnerConfig:
        """What a learner rank needs: the learner section, the PPO update, the run seed and
        the sampling temperature and truncation (the learner scores the distribution sampled from)."""
        pick = lambda obj, cls: {f.name: getattr(obj, f.name) for f in fields(cls)}
        return LearnerConfig(**pick(self.learner, TrainerConfig), ppo=PPOConfig(**pick(self.ppo, PPOConfig)),
                             seed=self.run.seed, temperature=self.generator.sampling.temperature,
                             top_k=self.generator.sampling.top_k, top_p=self.generator.sampling.top_p,
                             kl_loss_estimator=self.ppo.kl.estimator if self.ppo.kl.placement == "loss" else None)

    def to_dict(self) -> dict:
        """Plain nested dict that load_config accepts back."""
        return _plain(asdict(self))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _plain(x):
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _coerce(value, tp, key: str):
    """Check `value` against the annotated type `tp`; ints are accepted where floats are."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or str(origin) == "types.UnionType":
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key)
    if tp is tuple or origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config: {key} must be a list, got {value!r}")
        return tuple(value)
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
        return float(value)  # YAML 1.1 reads 6e-4 (no dot) as a string; it means a number here
    if tp in (int, str, bool) and isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        return value
    raise ConfigError(f"config: {key} must be {_type_name(tp)}, got {value!r} "
                      f"({type(value).__name__})")


def build_section(cls, data, prefix: str, root=None):
    """``cls`` from the nested dict ``data``; ``root``: the top-level class (for key hints)."""
    root = root or TetherConfig
    if not isinstance(data, dict):
        raise ConfigError(f"config: {prefix or 'the file'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise ConfigError(f"config: unknown key {full}{_unknown_key_hint(str(key), prefix, names, root)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = build_section(tp, value or {}, full, root)
        else:
            kwargs[key] = _coerce(value, tp, full)
    try:
        return cls(**kwargs)
    except ValueError as e:  # component dataclasses validate in __post_init__
        raise ConfigError(f"config: {prefix}: {e}") from None


def _all_paths(cls=None, prefix: str = "") -> list[str]:
    """Every dotted key of the config, sections and leaves alike ("ppo.kl", "ppo.kl.beta")."""
    cls = cls or TetherConfig
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        out.append(prefix + f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            out.extend(_all_paths(hints[f.name], f"{prefix}{f.name}."))
    return out


def _unknown_key_hint(key: str, prefix: str, names: list[str], root=None) -> str:
    """Where the key probably belongs: the same name in another section (a key put in the
    wrong section is the commonest mistake), else a near spelling here, else anywhere."""
    paths = _all_paths(root)
    named = lambda name: [p for p in paths if p.rsplit(".", 1)[-1] == name]
    where = f" ({key} is not a {prefix} key)" if prefix else f" ({key} is not a section)"
    if named(key):
        return f"{where}; did you mean {_either(named(key))}?"
    near = difflib.get_close_matches(key, names, n=1)
    if near:
        return f"; did you mean {(prefix + '.' if prefix else '') + near[0]}?"
    near = difflib.get_close_matches(key, sorted({p.rsplit('.', 1)[-1] for p in paths}), n=1)
    if near:
        return f"{where}; did you mean {_either(named(near[0]))}?"
    return f"; valid keys: {', '.join(names)}"


def _either(paths: list[str]) -> str:
    return paths[0] if len(paths) == 1 else ", ".join(paths[:-1]) + " or " + paths[-1]


def apply_override(data: dict, override: str) -> None:
    """Set `a.b.c=value` in the nested dict; the value is parsed as YAML (0.1, true, null, [1, 2])."""
    if "=" not in override:
        raise ConfigError(f"config: override {override!r} must look like section.key=value")
    key, raw = override.split("=", 1)
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    node = data
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"config: override {key} goes through {part}, which is not a section")
    node[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TetherConfig:
    cfg = build_section(TetherConfig, read_config(path, overrides), "")
    validate(cfg)
    return cfg


def read_config(path: str | Path | None = None, overrides: list[str] = ()) -> dict:
    """The YAML file (if any) with the dotted overrides applied, as a nested dict."""
    data = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config: file {str(p)!r} not found; pass --config path/to/file.yaml")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            problem = " ".join(str(getattr(e, "problem", None) or "").split())
            raise ConfigError(f"config: {p} is not valid YAML{where}" + (f" ({problem})" if problem else "")
                              + "; fix the YAML there") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config: {p} is not UTF-8 text; save it as UTF-8") from None
    for o in overrides:
        apply_override(data, o)
    return data


def validate(cfg: TetherConfig) -> None:
    """Cross-field checks: what each section alone cannot see."""
    for name in ("generator", "reference", "reward", "learner"):
        pool = getattr(cfg, name)
        if pool.replicas < 1:
            raise ConfigError(f"config: {name}.replicas={pool.replicas} must be >= 1")
        if pool.num_cpus < 0 or pool.num_gpus < 0:
            raise ConfigError(f"config: {name}.num_cpus/num_gpus must be >= 0")
    if cfg.generator.tensor_parallel > 1 and cfg.generator.num_gpus < cfg.generator.tensor_parallel:
        raise ConfigError(f"config: generator.tensor_parallel={cfg.generator.tensor_parallel} needs "
                          f"generator.num_gpus >= {cfg.generator.tensor_parallel} per replica")
    if (cfg.reward.model is None) == (cfg.reward.function is None):
        raise ConfigError("config: set exactly one of reward.model and reward.function "
                          "(the other to null)")
    if cfg.reward.normalize and cfg.reward.model is None:
        raise ConfigError("config: reward.normalize standardises reward-model scores; set reward.model "
                          "(a reward-model checkpoint with reward_stats.json) or reward.normalize=false")
    if not 0 <= cfg.reward.max_invalid_fraction <= 1:
        raise ConfigError(f"config: reward.max_invalid_fraction={cfg.reward.max_invalid_fraction} must be in [0, 1] "
                          "(the share of a step's scores that may be invalid)")
    if cfg.run.mode not in ("sync", "async"):
        raise ConfigError(f"config: run.mode={cfg.run.mode!r} must be sync or async")
    if cfg.ppo.old_logprobs == "behaviour" and cfg.run.mode != "sync":
        raise ConfigError("config: ppo.old_logprobs=behaviour takes the sampler's log-probs as the update's "
                          "starting policy, which holds in sync mode only; set run.mode=sync or "
                          "ppo.old_logprobs=recompute")
    if cfg.resources.cpu_threads not in ("phase", "reserved"):
        raise ConfigError(f"config: resources.cpu_threads={cfg.resources.cpu_threads!r} must be phase or reserved")
    if min(cfg.run.plot_every, cfg.run.eval_every, cfg.run.save_every, cfg.run.samples_every,
           cfg.run.alarm_window) < 0:
        raise ConfigError("config: run.plot_every/eval_every/save_every/samples_every/alarm_window must be >= 0")
    if cfg.run.checkpoint_every < 0 or cfg.run.keep_checkpoints < 1:
        raise ConfigError("config: run.checkpoint_every must be >= 0 and run.keep_checkpoints >= 1")
    if cfg.run.steps < 1:
        raise ConfigError(f"config: run.steps={cfg.run.steps} must be >= 1")
    check_run_name(cfg.run.name)
    if cfg.buffer.max_staleness < 0 or cfg.buffer.capacity < 1 or cfg.buffer.timeout_s <= 0:
        raise ConfigError("config: buffer.max_staleness must be >= 0, buffer.capacity >= 1 and "
                          "buffer.timeout_s > 0")
    if cfg.data.prompts_per_step < 1:
        raise ConfigError(f"config: data.prompts_per_step={cfg.data.prompts_per_step} must be >= 1")
    if cfg.data.eval_prompts < 0:
        raise ConfigError(f"config: data.eval_prompts={cfg.data.eval_prompts} must be >= 0 (0 = no evaluation set)")
    if cfg.data.max_prompt_tokens is not None and cfg.data.max_prompt_tokens < 1:
        raise ConfigError(f"config: data.max_prompt_tokens={cfg.data.max_prompt_tokens} must be >= 1, "
                          "or null to keep prompts of any length")
    _check_lengths(cfg.generator, cfg.data.max_prompt_tokens)
    kl_problem = kl_placement_error(cfg.ppo.kl.placement, cfg.ppo.kl.estimator)
    if kl_problem:
        raise ConfigError(f"config: {kl_problem}")
    if cfg.ppo.kl.beta < 0:
        raise ConfigError(f"config: ppo.kl.beta={cfg.ppo.kl.beta} must be >= 0 (0 = no KL penalty)")
    if cfg.ppo.kl.target is not None and cfg.ppo.kl.target <= 0:
        raise ConfigError(f"config: ppo.kl.target={cfg.ppo.kl.target} must be > 0, or null for a fixed beta")
    rollouts = cfg.data.prompts_per_step * cfg.generator.sampling.n
    if rollouts < cfg.ppo.minibatch_size:
        raise ConfigError(f"config: a step makes {rollouts} rollouts (data.prompts_per_step x "
                          f"generator.sampling.n) but ppo.minibatch_size={cfg.ppo.minibatch_size}; "
                          "lower the minibatch or raise prompts_per_step")
    if cfg.buffer.capacity < rollouts:
        raise ConfigError(f"config: buffer.capacity={cfg.buffer.capacity} is below the "
                          f"{rollouts} rollouts of one step; raise it")
    # Async: the learner waits for a step's rollouts while the producer waits for room to store
    # a whole chunk; with one generator a chunk is half a step's prompts (cluster/runtime/rollouts.py).
    chunk = -(-cfg.data.prompts_per_step // 2) * cfg.generator.sampling.n
    if cfg.run.mode == "async" and cfg.buffer.capacity < rollouts + chunk - 1:
        raise ConfigError(f"config: buffer.capacity={cfg.buffer.capacity} can stall async mode: the learner "
                          f"waits for a step's {rollouts} rollouts while the producer waits for room for a "
                          f"chunk of up to {chunk}; raise it to at least {rollouts + chunk - 1}")
    try:
        cfg.learner_config().validate(world_size=cfg.learner.replicas)
    except ValueError as e:
        raise ConfigError(f"config: {str(e).replace('learner.ppo.', 'ppo.')}") from None
    _check_ptx(cfg)
    # Every learner rank must get an equal shard (core.rollout.shard_rollouts drops the rest),
    # so a step that does not divide evenly would throw rollouts away every step.
    if rollouts % cfg.learner.replicas:
        raise ConfigError(f"config: a step makes {rollouts} rollouts (data.prompts_per_step x generator.sampling.n), "
                          f"not divisible by learner.replicas={cfg.learner.replicas}; make prompts_per_step x n "
                          f"a multiple of {cfg.learner.replicas}")


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


def _check_lengths(gen: GeneratorPoolConfig, max_prompt_tokens: Optional[int]) -> None:
    """Prompt and response share the engine's context: max_model_len must hold both."""
    new, room = gen.sampling.max_new_tokens, gen.engine.max_model_len
    if new >= room:
        raise ConfigError(f"config: generator.sampling.max_new_tokens={new} leaves no room for a prompt in "
                          f"generator.engine.max_model_len={room}; raise max_model_len or lower max_new_tokens")
    if max_prompt_tokens is not None and max_prompt_tokens + new > room:
        raise ConfigError(f"config: data.max_prompt_tokens={max_prompt_tokens} + generator.sampling.max_new_tokens="
                          f"{new} exceed generator.engine.max_model_len={room}; raise max_model_len or lower one of them")


def describe(root=None) -> str:
    """Every field with its default and comment, for --help-config."""
    import inspect

    lines = []

    def walk(cls, prefix):
        src = "\n".join(inspect.getsource(c) for c in cls.__mro__ if dataclasses.is_dataclass(c))
        for f in fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            comment = ""
            for line in src.splitlines():
                if line.strip().startswith(f"{f.name}:") and "#" in line:
                    comment = line.split("#", 1)[1].strip()
            lines.append(f"{prefix}{f.name} = {default!r}" + (f"    # {comment}" if comment else ""))

    walk(root or TetherConfig, "")
    return "\n".join(lines)

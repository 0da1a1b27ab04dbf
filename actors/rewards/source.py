"""Which source scores a PPO run's rollouts, and what each source needs: one table.

Exactly one of reward.function, reward.model, reward.url, reward.judge.model and reward.sources
is set (cluster/config/ppo.py checks it), but with ``env.reward: environment`` none of them scores:
the episodes' own rewards do. reward.sources is a source made of parts (``RewardPart``: a name, a
weight and one of the other sources with its own settings; ``reward_parts``): a replica scores
each part as it would that source alone and combines their scores (actors/rewards/combine.py).
Every place that says, sizes, starts or probes the reward (the
start-up line, the memory estimate, the threads, the pools started, the probe, the reward
replica's scorer, the invalid-scores message) asks ``reward_source`` and reads the table's
entry, so none of them can read the wrong setting. Adding a source is one entry here and its
scorer (docs/extending.md).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional


@dataclass(frozen=True)
class SourceType:
    """One kind of reward source and what it needs."""
    name: str                                   # the table's key: function | model | url | judge | environment
    label: str                                  # how messages name a source of this type, before its spec
    key: str                                    # the config key that sets it
    setting: Callable[[object], Optional[str]]  # its spec in a RewardConfig (None: not this source)
    cleared: Callable[[object], object] = lambda w: w  # the RewardConfig with this source's key unset
    weights: bool = False                       # replicas load a model of their own (memory, a dtype)
    engine: bool = False                        # replicas host a vLLM engine (its KV cache counts too)
    episodes: bool = False                      # the scores are the episodes' own: no replica scores them
    # The text scorer a replica builds (actors/rewards/scoring.py's TextScorer), from the source, the
    # reward section, the config key it answers to, the engine's dtype and seed; None: not a text source.
    text_scorer: Optional[Callable] = None
    # The token scorer a replica builds (a reward model's forward on the sampled ids), from the
    # source, the reward section, the dtype and the device; None: not a token source.
    token_scorer: Optional[Callable] = None


def _function_scorer(source, config, *, key: str, dtype=None, seed: int = 0):
    """A function called in the replica, or with reward.sandbox.workers > 0 in worker processes."""
    from actors.rewards.sandbox import SandboxScorer
    from actors.rewards.scoring import FunctionScorer, load_function

    name = f"reward function {source.spec}" if key == "reward.function" else f"{key} {source.spec}"
    box = config.sandbox
    if box.workers > 0:
        return SandboxScorer(source.spec, name=name, key=key, workers=box.workers, timeout_s=box.timeout_s,
                             memory_mb=box.memory_mb)
    return FunctionScorer(load_function(source.spec, key), name=name, timeout_s=config.timeout_s)


def _server_scorer(source, config, **_):
    from actors.rewards.http import HTTPScorer

    return HTTPScorer(source.spec, config.http)


def _judge_scorer(source, config, *, dtype=None, seed: int = 0, **_):
    """The judge's engine in this process; ``config.judge.model`` is the resolved path (source.spec)."""
    from actors.rewards.group_judge import GroupJudgeScorer
    from actors.rewards.judge import JudgeScorer

    judge = GroupJudgeScorer if config.judge.mode == "group" else JudgeScorer  # group: one call per prompt
    return judge(replace(config.judge, model=source.spec), dtype=dtype, seed=seed)


def no_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """Every pair scores 0: a run whose teacher is its whole signal (pure distillation)."""
    return [0.0] * len(responses)


def _no_reward_scorer(source, config, **_):
    from actors.rewards.scoring import FunctionScorer

    return FunctionScorer(no_reward, name="no reward (the teacher alone)", timeout_s=config.timeout_s)


def _model_scorer(source, config, *, dtype: str, device):
    """The reward model in this process."""
    from actors.rewards.reward_model import RewardModelScorer
    from core.infra.dtypes import torch_dtype

    return RewardModelScorer(source.spec, dtype=torch_dtype(dtype, "Reward"), device=device,
                             batch_size=config.batch_size, packing=config.packing, normalize=config.normalize)


SOURCES: dict[str, SourceType] = {t.name: t for t in (
    SourceType("model", "reward model", "reward.model", lambda w: w.model, lambda w: replace(w, model=None),
               weights=True, token_scorer=_model_scorer),
    SourceType("function", "reward function", "reward.function", lambda w: w.function,
               lambda w: replace(w, function=None), text_scorer=_function_scorer),
    SourceType("url", "reward server", "reward.url", lambda w: w.url, lambda w: replace(w, url=None),
               text_scorer=_server_scorer),
    SourceType("judge", "reward judge", "reward.judge.model", lambda w: w.judge.model,
               lambda w: replace(w, judge=replace(w.judge, model=None)), weights=True, engine=True,
               text_scorer=_judge_scorer),
    SourceType("environment", "environment", "env.environment", lambda w: None, episodes=True),
    SourceType("agent", "agent", "env.agent", lambda w: None, episodes=True),
    # No reward key set and a teacher: every score is 0, the teacher's term the whole advantage.
    SourceType("teacher", "teacher", "teacher.model", lambda w: None, text_scorer=_no_reward_scorer),
    SourceType("sources", "reward sources", "reward.sources",
               lambda w: ", ".join(s.name for s in w.sources) if getattr(w, "sources", ()) else None,
               lambda w: replace(w, sources=())),
)}


@dataclass(frozen=True)
class RewardSource:
    type: SourceType
    spec: str  # the function's module:function, the model's path, the URL, the judge model, the environment class
    parts: tuple = ()  # reward.sources: its RewardParts; () for the other sources

    @property
    def name(self) -> str:
        """For messages: "reward function mod:fn", "environment mod:Class", ..."""
        return f"{self.type.label} {self.spec}"

    @property
    def holds_model(self) -> bool:
        """Whether the reward replicas load a model of their own (its weights in their memory)."""
        return self.type.weights or any(p.source.holds_model for p in self.parts)

    @property
    def from_episodes(self) -> bool:
        """Whether the scores are the episodes' own (no reward replica calls a scorer for them)."""
        return self.type.episodes

    def text_scorer(self, config, *, key: Optional[str] = None, dtype: Optional[str] = None, seed: int = 0):
        """This source's text scorer, built from ``config`` (a RewardConfig); None where it scores
        token ids (a reward model) or the episodes carry the scores."""
        if self.type.text_scorer is None:
            return None
        return self.type.text_scorer(self, config, key=key or self.type.key, dtype=dtype, seed=seed)

    def token_scorer(self, config, *, dtype, device):
        """This source's token scorer (a reward model, in ``dtype``: "float32", "bfloat16", ...), built from
        ``config`` (a RewardConfig); None for the other sources."""
        if self.type.token_scorer is None:
            return None
        return self.type.token_scorer(self, config, dtype=dtype, device=device)

    @property
    def summary(self) -> str:
        """The start-up line's words for it: "function mod:fn", "the environment's", ..."""
        if self.parts:
            return " + ".join(f"{p.name}={p.source.summary} x{p.weight:g}" for p in self.parts)
        return f"the {self.type.label}'s" if self.from_episodes else self.name.removeprefix("reward ")


@dataclass(frozen=True)
class RewardPart:
    """One of reward.sources: its name, its weight, the source and the settings it is built from
    (a RewardConfig holding that source alone)."""
    name: str
    weight: float
    source: RewardSource
    config: object


def given_sources(reward) -> list[RewardSource]:
    """The sources ``reward`` (a RewardConfig) sets, in the table's order: one, in a valid config."""
    return [RewardSource(t, spec, parts=reward_parts(reward) if t.name == "sources" else ())
            for t in SOURCES.values() if (spec := t.setting(reward)) is not None]


def part_sources(item) -> list[RewardSource]:
    """The sources one reward.sources item (a RewardSourceConfig) sets: one, in a valid config."""
    given = given_sources(part_config(item))
    return given + ([RewardSource(SOURCES["environment"], "episodes")] if item.environment else [])


def part_config(item):
    """The RewardConfig a reward.sources item scores with: its own settings, no other source."""
    from actors.rewards.config import RewardConfig, scorer_settings

    return RewardConfig(**scorer_settings(item))


def reward_parts(reward) -> tuple[RewardPart, ...]:
    """reward.sources as RewardParts (``reward``: a RewardConfig with sources set); a one-line
    ValueError for an item that sets no source or more than one."""
    parts = []
    for i, item in enumerate(reward.sources):
        given = part_sources(item)
        if len(given) != 1:
            got = ", ".join(s.type.key.removeprefix("reward.").removeprefix("env.") for s in given) or "none"
            raise ValueError(f"reward.sources[{i}] ({item.name!r}) must set exactly one of function, model, url, "
                             f"judge.model and environment: true (got {got})")
        parts.append(RewardPart(item.name, float(item.weight), given[0], part_config(item)))
    return tuple(parts)


def one_source_rule() -> str:
    """What a valid reward section sets, for the messages that refuse another."""
    keys = [t.key for t in SOURCES.values() if not t.episodes and t.name not in ("sources", "teacher")]
    return f"set exactly one of {', '.join(keys[:-1])} and {keys[-1]}, or several in reward.sources"


def configured_source(reward) -> RewardSource:
    """The one source ``reward`` (a RewardConfig) sets; a one-line ValueError unless exactly one
    of the table's settings is given (the config check says the same to a user)."""
    given = given_sources(reward)
    if len(given) != 1:
        got = ", ".join(f"{s.type.key}={s.spec!r}" for s in given) or "none"
        raise ValueError(f"reward: {one_source_rule()} (got {got})")
    return given[0]


def gold_source(reward) -> RewardSource:
    """reward.gold as a source: a function (``reward``: a RewardConfig with gold set)."""
    return RewardSource(SOURCES["function"], reward.gold)


def judge_engines(reward, source: RewardSource) -> list:
    """The EngineConfig of each judge engine a reward replica of ``source`` hosts (``reward``: its
    RewardConfig): reward.judge's own, or each judge among reward.sources."""
    own = [reward.judge.engine] if source.type.engine else []
    return own + [engine for p in source.parts for engine in judge_engines(p.config, p.source)]


def reward_source(cfg) -> RewardSource:
    """The source of the scores the run trains on (``cfg``: a TetherConfig)."""
    if cfg.env.enabled and cfg.env.reward == "environment":
        return RewardSource(SOURCES["agent" if cfg.env.agent else "environment"], cfg.env.player)
    if cfg.teacher.enabled and not given_sources(cfg.reward):  # pure distillation
        return RewardSource(SOURCES["teacher"], cfg.teacher.model)
    return configured_source(cfg.reward)


def reward_pool_replicas(cfg) -> int:
    """The reward pool's replicas: none when the environment scores and no reward.gold needs a
    replica to score the evaluation (then the dispatcher reads the episodes' scores without one,
    cluster/runtime/pools/environment_scores.py)."""
    if reward_source(cfg).from_episodes and cfg.reward.gold is None:
        return 0
    return cfg.reward.replicas


def without_unused_reward(cfg):
    """``cfg`` as start-up checks it: with the environment scoring, the reward.* sources cleared,
    so that none is loaded, probed or asked for its columns (reward.gold, still called on the
    evaluation, stays)."""
    if not reward_source(cfg).from_episodes:
        return cfg
    w = cfg.reward
    for t in SOURCES.values():
        w = t.cleared(w)
    return replace(cfg, reward=w)

"""Settings the run would ignore: an env.* or reward.* key changed from its default that has no
effect in this configuration (episodes off, another reward source scoring) is refused in one line,
as a misspelt key is, so a run never goes to its end without what its config asked for.

A key is "set" when its value differs from its default: writing a default out is harmless.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

from actors.rewards.source import reward_source
from cluster.config.loader import ConfigError, default_of

# reward.* keys and the reward sources they act on ("gold": while reward.gold is set). Keys not
# listed (the source keys themselves, gold, max_invalid_fraction, the pool's resources) are
# checked elsewhere or act on any source.
REWARD_KEYS = {
    "batch_size": ("model",),
    "packing": ("model",),
    "normalize": ("model",),
    "timeout_s": ("function", "gold"),
    "sandbox": ("function", "gold"),
    "http": ("url",),
    "judge": ("judge",),
}


def changed(section, prefix: str) -> Iterator[tuple[str, object]]:
    """(dotted key, value) of each key of ``section`` (a config dataclass) that differs from its
    default, nested sections walked."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            yield from changed(value, f"{prefix}.{f.name}")
        elif value != default_of(f):
            yield f"{prefix}.{f.name}", value


# The env.* keys that act on an environment's episodes alone (the policy's turns, how observations
# are rendered) and the one that acts on an agent's alone.
ENVIRONMENT_ONLY = ("max_turns", "max_turn_tokens", "step_timeout_s", "observation_role", "plain_format",
                    "reward_placement", "schedule")
AGENT_ONLY = ("episode_timeout_s", "episodes_per_worker", "tool_parser")


def check_ineffective(cfg) -> None:
    """One line for the first env.* / reward.* key of ``cfg`` (a TetherConfig) set without effect."""
    if not cfg.env.enabled:
        for key, value in changed(cfg.env, "env"):
            raise ConfigError(f"config: {key}={value!r} has no effect without env.environment or env.agent "
                              f"(single-turn responses); set env.environment or env.agent to play episodes, "
                              f"or remove {key}")
    unused = ENVIRONMENT_ONLY if cfg.env.agent else AGENT_ONLY if cfg.env.enabled else ()
    for key, value in changed(cfg.env, "env"):
        if key.removeprefix("env.") in unused:
            raise ConfigError(f"config: {key}={value!r} has no effect on the episodes of {cfg.env.player_key}="
                              f"{cfg.env.player!r}; remove {key}")
    source = reward_source(cfg)
    if source.from_episodes:
        sources = {f"reward.{key}": getattr(cfg.reward, key) for key in ("function", "model", "url")}
        sources["reward.judge.model"] = cfg.reward.judge.model
        for key, value in sources.items():  # null: the default source turned off, not a source
            if value is not None and (key != "reward.function" or value != _default(cfg.reward, "function")):
                raise ConfigError(f"config: {key}={value!r} is never called with env.reward=environment (the "
                                  f"episodes' own rewards score them); set env.reward=pool to score transcripts "
                                  f"with it, or remove {key}")
    acting = {source.type.name} | ({"gold"} if cfg.reward.gold is not None else set())
    for key, kinds in REWARD_KEYS.items():
        value = getattr(cfg.reward, key)
        pairs = changed(value, f"reward.{key}") if dataclasses.is_dataclass(value) else (
            [(f"reward.{key}", value)] if value != _default(cfg.reward, key) else [])
        for path, v in pairs:
            if path != "reward.judge.model" and not acting & set(kinds):
                raise ConfigError(f"config: {path}={v!r} has no effect: it acts on {_names(kinds)}, and this run "
                                  f"is scored by the {source.name}; remove {path}")


def _default(section, key: str):
    return default_of(next(f for f in dataclasses.fields(section) if f.name == key))


_SOURCE_KEYS = {"function": "reward.function", "model": "reward.model", "url": "reward.url",
                "judge": "reward.judge.model", "gold": "reward.gold"}


def _names(kinds: tuple) -> str:
    return " or ".join(_SOURCE_KEYS[k] for k in kinds)

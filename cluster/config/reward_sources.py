"""The checks of a composed reward (reward.sources, reward.combine) and of a group judge
(reward.judge.mode=group) that need more than the reward section: the prompts' sample count
(generator.sampling.n) and the episodes (env.*). Each mistake is one line naming the key and the fix.
"""
from __future__ import annotations

import math
import re

from actors.rewards.config import check_reward_http, check_sandbox
from actors.rewards.source import SOURCES, part_sources
from core.infra.schema import ConfigError

NAME = re.compile(r"[A-Za-z0-9_-]+")  # a source's name is one path segment of its metrics: reward/<name>/mean
SINGLE_KEYS = tuple(t.key for t in SOURCES.values() if not t.episodes and t.name not in ("sources", "teacher"))


def check_reward_sources(cfg) -> None:
    """reward.sources' items, reward.combine and group judges against ``cfg`` (a TetherConfig)."""
    reward, n = cfg.reward, cfg.generator.sampling.n
    _check_group_judge(reward.judge, "reward.judge", n)
    if not reward.sources:
        return
    given = [key for key, value in _single_values(reward).items() if value is not None]
    if given:
        raise ConfigError(f"config: reward.sources replaces {', '.join(SINGLE_KEYS)}; set {given[0]}=null "
                          f"(it is {_single_values(reward)[given[0]]!r}) and give it as a source of the list")
    if cfg.env.enabled and cfg.env.reward == "environment":
        raise ConfigError("config: reward.sources is never scored with env.reward=environment (the episodes' own "
                          "rewards are the score); set env.reward=pool, with a source {name: ..., environment: true} "
                          "for the episodes' own score")
    names = [item.name for item in reward.sources]
    for i, item in enumerate(reward.sources):
        _check_item(i, item, cfg)
    duplicate = next((x for x in names if names.count(x) > 1), None)
    if duplicate is not None:
        raise ConfigError(f"config: reward.sources names {duplicate!r} twice; give each source a name of its own "
                          "(its metrics are reward/<name>/mean)")
    if not any(item.weight > 0 for item in reward.sources) and not cfg.teacher.enabled:
        raise ConfigError(f"config: reward.sources has no trainable weight (every weight is 0: {', '.join(names)} "
                          "are monitors only); give at least one source a weight > 0, or set teacher.model to "
                          "distil with these as monitors")
    if reward.combine == "gdpo" and n < 2:
        raise ConfigError(f"config: reward.combine=gdpo normalises each source within a prompt's group of samples, "
                          f"and generator.sampling.n={n} leaves one per group; raise generator.sampling.n to 2 or "
                          "more, or set reward.combine=sum")


def _single_values(reward) -> dict:
    """The single-source keys' values in ``reward`` (None: not set)."""
    return {t.key: t.setting(reward) for t in SOURCES.values() if t.key in SINGLE_KEYS}


def _check_item(i: int, item, cfg) -> None:
    where = f"reward.sources[{i}]"
    if not NAME.fullmatch(item.name):
        raise ConfigError(f"config: {where}.name={item.name!r} must be a name of letters, digits, _ and - (its "
                          "metrics are reward/<name>/mean); name the source")
    where = f"{where} ({item.name})"
    if not (math.isfinite(item.weight) and item.weight >= 0):
        raise ConfigError(f"config: {where}.weight={item.weight} must be a finite number >= 0 (0 = a monitor)")
    given = part_sources(item)
    if len(given) != 1:
        got = ", ".join(s.type.key.removeprefix("reward.") for s in given) or "none"
        raise ConfigError(f"config: {where} must set exactly one of function, model, url, judge.model and "
                          f"environment: true (got {got})")
    if item.environment and not (cfg.env.enabled and cfg.env.reward == "pool"):
        raise ConfigError(f"config: {where}.environment=true scores with the episodes' own rewards; set "
                          "env.environment or env.agent, with env.reward=pool")
    if item.normalize and item.model is None:
        raise ConfigError(f"config: {where}.normalize standardises reward-model scores; set its model or "
                          "normalize=false")
    if not item.timeout_s > 0:
        raise ConfigError(f"config: {where}.timeout_s={item.timeout_s} must be > 0 (seconds a call may take)")
    try:
        check_reward_http(item.url, item.http)
        check_sandbox(item.sandbox)
    except ConfigError as e:  # the same checks as the single keys', said of this source
        raise ConfigError(str(e).replace("reward.", f"{where}.", 1)) from None
    if item.judge.model is not None:
        _check_group_judge(item.judge, f"{where}.judge", cfg.generator.sampling.n)


def _check_group_judge(judge, key: str, n: int) -> None:
    if judge.model is not None and judge.mode == "group" and n < 2:
        raise ConfigError(f"config: {key}.mode=group judges a prompt's samples together, and "
                          f"generator.sampling.n={n} gives it one; raise generator.sampling.n to 2 or more, or set "
                          f"{key}.mode=pair")

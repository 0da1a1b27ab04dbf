"""The episode runner a generator plays env.environment's episodes with, by env.schedule."""
from __future__ import annotations

from actors.environments.config import EnvConfig
from actors.environments.continuous import ContinuousEpisodes
from actors.environments.episodes import EpisodeRunner
from actors.environments.transcript import ObservationTokens
from actors.environments.workers import EnvironmentWorkers

# env.schedule -> the runner: lockstep rounds (a redispatched chunk samples the same tokens), or
# each episode at its own pace (turns admitted into the running engine, steps taken as they come).
SCHEDULES = {"rounds": EpisodeRunner, "continuous": ContinuousEpisodes}


def episode_runner(env: EnvConfig, tokenizer, *, max_context: int, max_new_tokens: int,
                   name: str) -> EpisodeRunner:
    """The runner a generator plays episodes with, from the ``env`` section; observations
    rendered by the policy's ``tokenizer``; a turn is at most ``max_new_tokens`` where
    env.max_turn_tokens is 0."""
    runner = SCHEDULES[env.schedule]
    workers = EnvironmentWorkers(env.environment, key="env.environment", workers=env.workers,
                                 step_timeout_s=env.step_timeout_s, memory_mb=env.memory_mb)
    try:
        observations = ObservationTokens(tokenizer, role=env.observation_role, plain_format=env.plain_format,
                                         name=f"{name}'s tokenizer")
    except ValueError:
        workers.close()
        raise
    return runner(workers=workers, observations=observations,
                  decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                  max_turns=env.max_turns, max_tokens=env.max_tokens,
                  max_turn_tokens=env.turn_tokens(max_new_tokens), max_context=max_context,
                  by_turn=env.reward_placement == "turn")

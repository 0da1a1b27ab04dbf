"""env: multi-turn episodes against an environment (actors/environments/episodes.py, actors/environments/base.py)."""
from __future__ import annotations

from typing import Literal, Optional

from core.infra.schema import ConfigError, config_class, setting

EnvReward = Literal["environment", "pool"]
RewardPlacement = Literal["episode", "turn"]
Schedule = Literal["rounds", "continuous"]


@config_class
class EnvConfig:
    """Episodes: the policy acts, an environment answers, up to max_turns turns per episode."""
    environment: Optional[str] = setting(None, "a `module:Class` with reset(prompt, columns) and step(action) "
                                               "(docs/guide/environments.md), e.g. actors.environments:Calculator; "
                                               "null = single-turn responses")
    agent: Optional[str] = setting(None, "a `module:function` (plain or async) that plays one episode through "
                                         "an OpenAI-compatible endpoint, called with the prompt's text, its "
                                         "columns and a client on its session's URL (docs/guide/agents.md); "
                                         "instead of env.environment")
    reward: EnvReward = setting("environment", "environment: an episode's score is its environment rewards "
                                               "summed, or what the agent returned or posted (the reward.* "
                                               "scorer is not called) | pool: the reward pool scores the final "
                                               "transcript")
    reward_placement: RewardPlacement = setting(
        "episode", "with reward=environment: episode = the rewards summed as the episode's score, on its last "
                   "token | turn = each turn's reward on that turn's last token (credit per turn: GAE "
                   "bootstraps across turns, the group estimators compare each turn's return with the "
                   "same turn of the group's other samples; the score is still the sum)")
    schedule: Schedule = setting(
        "rounds", "with env.environment: rounds = every live episode's next turn sampled in one call, then "
                  "their steps in one round (a redispatched or resumed chunk samples the same tokens) | "
                  "continuous = each episode at its own pace: a turn enters the running engine as soon as its "
                  "episode has one to take and goes to its environment as soon as it ends (faster; the "
                  "same seeds and distribution, but what a turn is batched with depends on timing, so a "
                  "redispatched chunk need not sample the same tokens)")
    max_turns: int = setting(4, "policy turns per episode at most")
    max_tokens: int = setting(512, "response tokens per episode at most, observations included")
    max_turn_tokens: int = setting(0, "tokens per turn at most (a turn also ends at EOS); 0 = "
                                      "generator.sampling.max_new_tokens")
    workers: int = setting(2, "environment or agent worker processes per generator (a crash or a hang "
                              "ends the episodes it held, never the generator)")
    episodes_per_worker: int = setting(8, "with env.agent: episodes one agent worker plays at once (an async "
                                          "agent's as tasks of one event loop, a plain one's in threads); a "
                                          "worker that dies takes its episodes with it")
    tool_parser: Optional[str] = setting(None, "with env.agent: the vLLM tool parser that reads tool calls from "
                                               "the policy's chat answers when a call passes tools (hermes for "
                                               "Qwen's <tool_call> tags, llama3_json, mistral, ...); null = "
                                               "answers are text")
    episode_timeout_s: float = setting(300.0, "with env.agent: an episode not over within this many seconds "
                                              "ends invalid (its agent's worker is killed and replaced)")
    step_timeout_s: float = setting(30.0, "a reset or step not answered within this many seconds ends its "
                                          "episode as invalid (its worker is killed and replaced)")
    memory_mb: int = setting(0, "each environment or agent worker's memory cap in MiB; 0 = none")
    observation_role: str = setting("user", "the chat role an observation is rendered as (the tokenizer's "
                                            "chat template)")
    plain_format: str = setting("\n{observation}\n", "without a chat template: the text appended per "
                                                      "observation")

    @property
    def enabled(self) -> bool:
        """Episodes are played (of an environment or an agent), not single responses."""
        return self.environment is not None or self.agent is not None

    @property
    def player(self) -> Optional[str]:
        """The spec that plays the episodes: env.environment or env.agent."""
        return self.agent or self.environment

    @property
    def player_key(self) -> str:
        return "env.agent" if self.agent else "env.environment"

    def turn_tokens(self, max_new_tokens: int) -> int:
        """Tokens per policy turn at most: max_turn_tokens, or the generator's max_new_tokens."""
        return self.max_turn_tokens or max_new_tokens


def check_env(env: EnvConfig) -> None:
    """One line naming the key and the fix for settings episodes cannot run with."""
    if not env.enabled:
        return
    if env.environment is not None and env.agent is not None:
        raise ConfigError(f"config: env.environment={env.environment!r} and env.agent={env.agent!r} both play "
                          "episodes; set one of them")
    if env.episodes_per_worker < 1:
        raise ConfigError(f"config: env.episodes_per_worker={env.episodes_per_worker} must be >= 1")
    if not env.episode_timeout_s > 0:
        raise ConfigError(f"config: env.episode_timeout_s={env.episode_timeout_s} must be > 0 (seconds)")
    if min(env.max_turns, env.max_tokens, env.workers) < 1 or env.max_turn_tokens < 0 or env.memory_mb < 0:
        raise ConfigError(f"config: env.max_turns={env.max_turns}, env.max_tokens={env.max_tokens} and "
                          f"env.workers={env.workers} must be >= 1, env.max_turn_tokens and env.memory_mb >= 0")
    if not env.step_timeout_s > 0:
        raise ConfigError(f"config: env.step_timeout_s={env.step_timeout_s} must be > 0 (seconds)")
    if "{observation}" not in env.plain_format or not env.observation_role:
        raise ConfigError("config: env.plain_format must hold {observation} and env.observation_role a role name")
    if env.reward_placement == "turn" and env.agent is not None:
        raise ConfigError("config: env.reward_placement=turn places an environment's rewards turn by turn; an agent "
                          "scores its episode as a whole: remove env.reward_placement")
    if env.reward_placement == "turn" and env.reward != "environment":
        raise ConfigError("config: env.reward_placement=turn places the environment's rewards; it needs "
                          "env.reward=environment (the pool scores whole transcripts)")

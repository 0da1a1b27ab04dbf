"""env.* and reward.* settings that would have no effect in the run's configuration are refused in
one line naming the key and the fix, as an unknown key is; their defaults written out are not."""
import pytest

from cluster.config.ppo import load_config
from core.infra.schema import ConfigError

pytestmark = pytest.mark.unit
EPISODES = ["env.environment=actors.environments:Calculator"]
URL = ["reward.function=null", "reward.url=http://127.0.0.1:9/score"]
JUDGE = ["reward.function=null", "reward.judge.model=builtin:judge"]
MODEL = ["reward.function=null", "reward.model=runs/rm"]
AGENT = ["env.agent=cluster.demo.arithmetic:second_chance_agent"]


@pytest.mark.parametrize("overrides, key, fix", [
    (["env.reward_placement=turn"], "env.reward_placement='turn'", "set env.environment"),
    (["env.max_turns=2"], "env.max_turns=2", "set env.environment"),
    (["env.reward=pool"], "env.reward='pool'", "set env.environment"),
    (EPISODES + URL, "reward.url=", "set env.reward=pool"),
    (EPISODES + JUDGE, "reward.judge.model=", "set env.reward=pool"),
    (EPISODES + ["reward.function=cluster.demo.arithmetic:exact_match"], "reward.function=", "env.reward=pool"),
    (["reward.http.timeout_s=5"], "reward.http.timeout_s=5", "acts on reward.url"),
    (["reward.judge.chat_template=true"], "reward.judge.chat_template=True", "acts on reward.judge.model"),
    (URL + ["reward.sandbox.workers=2"], "reward.sandbox.workers=2", "reward.function or reward.gold"),
    (URL + ["reward.timeout_s=5"], "reward.timeout_s=5", "scored by the reward server"),
    (["reward.batch_size=64"], "reward.batch_size=64", "acts on reward.model"),
    (JUDGE + ["reward.packing=false"], "reward.packing=False", "scored by the reward judge builtin:judge"),
    (EPISODES + ["reward.http.retries=1"], "reward.http.retries=1",
     "scored by the environment actors.environments:Calc"),
    (["env.episode_timeout_s=10"], "env.episode_timeout_s=10", "set env.environment or env.agent"),
    (AGENT + ["env.max_turns=2"], "env.max_turns=2", "no effect on the episodes of env.agent="),
    (AGENT + ["env.observation_role=tool"], "env.observation_role='tool'", "no effect on the episodes of env.agent"),
    (AGENT + ["env.schedule=continuous"], "env.schedule='continuous'", "no effect on the episodes of env.agent"),
    (["env.schedule=continuous"], "env.schedule='continuous'", "set env.environment"),
    (EPISODES + ["env.episode_timeout_s=10"], "env.episode_timeout_s=10",
     "no effect on the episodes of env.environment="),
    (AGENT + URL, "reward.url=", "set env.reward=pool"),
    (EPISODES + ["env.tool_parser=hermes"], "env.tool_parser='hermes'", "no effect on the episodes of env.environment"),
    (AGENT + ["reward.timeout_s=5"], "reward.timeout_s=5", "scored by the agent cluster.demo.arithmetic"),
])
def test_a_setting_without_effect_is_one_line(overrides, key, fix):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert key in str(e.value) and fix in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("overrides", [
    EPISODES + ["env.reward_placement=turn", "env.max_turns=2"],
    EPISODES + ["env.reward=pool", "reward.sandbox.workers=2", "reward.timeout_s=5"],
    AGENT + ["env.episode_timeout_s=10", "env.workers=4", "env.memory_mb=512", "env.max_tokens=40"],
    AGENT + URL + ["env.reward=pool", "reward.http.timeout_s=5"],
    URL + ["reward.http.timeout_s=5"],
    JUDGE + ["reward.judge.chat_template=true"],
    MODEL + ["reward.batch_size=64", "reward.packing=false"],
    URL + ["reward.gold=cluster.demo.sentiment:sentiment", "reward.sandbox.workers=2", "reward.timeout_s=5"],
    ["env.max_turns=4", "reward.http.timeout_s=30", "reward.batch_size=16"],  # the defaults written out
])
def test_settings_with_an_effect_load(overrides):
    load_config(None, overrides)

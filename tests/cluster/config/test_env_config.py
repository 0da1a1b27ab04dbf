"""The env section: off by default, and every setting episodes cannot run with is one line naming the key."""
import pytest

from cluster.config.ppo import load_config
from core.infra.schema import ConfigError

pytestmark = pytest.mark.unit
ON = ["env.environment=actors.environments:Calculator"]


def test_episodes_are_off_by_default_and_their_budget_is_the_learners_horizon():
    assert not load_config(None, []).env.enabled
    cfg = load_config(None, ON + ["env.max_tokens=300"])
    cfg.validate()
    assert cfg.learner_config().max_new_tokens == 300  # seq-mean-token-sum-norm's constant divisor
    assert cfg.env.turn_tokens(64) == 64


@pytest.mark.parametrize("overrides, says", [
    (["env.max_turns=0"], "env.max_turns=0"), (["env.step_timeout_s=0"], "env.step_timeout_s=0"),
    (["env.plain_format=x"], "env.plain_format must hold {observation}"),
    (["env.reward=judge"], "env.reward"), (["env.schedule=lockstep"], "env.schedule")])
def test_settings_episodes_cannot_run_with_are_one_line(overrides, says):
    with pytest.raises(ConfigError) as e:
        load_config(None, ON + overrides).validate()
    assert says in str(e.value) and "\n" not in str(e.value)


def test_rewards_per_turn_need_the_environments_rewards():
    cfg = load_config(None, ON + ["env.reward_placement=turn"])
    cfg.validate()
    assert cfg.env.reward_placement == "turn"
    with pytest.raises(ConfigError, match="needs env.reward=environment"):
        load_config(None, ON + ["env.reward_placement=turn", "env.reward=pool"]).validate()


def test_a_system_prompt_needs_the_chat_template():
    with pytest.raises(ConfigError, match="set data.chat_template=true"):
        load_config(None, ["data.system_prompt=Use tools."]).validate()
    load_config(None, ["data.system_prompt=Use tools.", "data.chat_template=true"]).validate()


AGENT = ["env.agent=cluster.demo.arithmetic:second_chance_agent"]


def test_an_agent_plays_the_episodes_instead_of_an_environment():
    cfg = load_config(None, AGENT + ["env.max_tokens=40"])
    cfg.validate()
    assert cfg.env.enabled and cfg.env.player == AGENT[0].split("=")[1] and cfg.env.player_key == "env.agent"
    assert cfg.learner_config().max_new_tokens == 40


@pytest.mark.parametrize("overrides, says", [
    (ON, "set one of them"), (["env.episode_timeout_s=0"], "env.episode_timeout_s=0"),
    (["env.reward_placement=turn"], "an agent scores its episode as a whole"),
    (["data.chat_template=true"], "set data.chat_template=false")])
def test_settings_an_agent_cannot_run_with_are_one_line(overrides, says):
    with pytest.raises(ConfigError) as e:
        load_config(None, AGENT + overrides).validate()
    assert says in str(e.value) and "\n" not in str(e.value)

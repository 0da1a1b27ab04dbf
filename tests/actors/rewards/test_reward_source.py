"""Which source scores a run (actors/rewards/source.py), named once: the start-up line says
it, and with the environment scoring no reward pool is started or checked."""
import pytest

from cluster.config.ppo import load_config

pytestmark = pytest.mark.unit
ENV = ["env.environment=cluster.demo.arithmetic:SecondChance"]  # env.reward=environment, the default
URL = ["reward.function=null", "reward.url=http://127.0.0.1:9/score"]
JUDGE = ["reward.function=null", "reward.judge.model=builtin:judge"]


@pytest.mark.parametrize("overrides, kind, name", [
    ([], "function", "reward function cluster.demo.sentiment:sentiment"),
    (["reward.function=null", "reward.model=/models/rm"], "model", "reward model /models/rm"),
    (URL, "url", "reward server http://127.0.0.1:9/score"),
    (JUDGE, "judge", "reward judge builtin:judge"),
    (ENV, "environment", "environment cluster.demo.arithmetic:SecondChance"),
    (ENV + ["env.reward=pool"], "function", "reward function cluster.demo.sentiment:sentiment"),
])
def test_each_setting_names_its_source(overrides, kind, name):
    from actors.rewards.source import reward_source
    source = reward_source(load_config(None, overrides))
    assert (source.type.name, source.name) == (kind, name)
    assert source.holds_model == (kind in ("model", "judge"))


def test_the_environment_scoring_starts_no_reward_pool_unless_the_gold_needs_one():
    from actors.rewards.source import reward_pool_replicas
    assert reward_pool_replicas(load_config(None, ["reward.replicas=2"])) == 2
    assert reward_pool_replicas(load_config(None, ENV + ["reward.replicas=2"])) == 0
    assert reward_pool_replicas(load_config(None, ENV + ["env.reward=pool"])) == 1
    gold = ["reward.gold=cluster.demo.arithmetic:reward_from_prompt"]
    assert reward_pool_replicas(load_config(None, ENV + gold)) == 1  # a replica scores the evaluation's gold


def test_start_up_checks_leave_out_a_reward_the_run_never_calls():
    from actors.rewards.source import without_unused_reward
    cfg = load_config(None, ENV + ["reward.gold=cluster.demo.arithmetic:reward_from_prompt"])
    checked = without_unused_reward(cfg).reward
    assert (checked.function, checked.model, checked.url, checked.judge.model) == (None, None, None, None)
    assert checked.gold == cfg.reward.gold  # still called on the evaluation
    pool = load_config(None, ENV + ["env.reward=pool"])
    assert without_unused_reward(pool) is pool


@pytest.mark.parametrize("overrides, said", [
    ([], "| reward function cluster.demo.sentiment:sentiment |"),
    (URL, "| reward server http://127.0.0.1:9/score |"),
    (JUDGE, "| reward judge builtin:judge |"),
])
def test_the_start_up_line_names_the_reward_and_its_pool(overrides, said):
    from cluster.runtime.service import startup_summary

    line = startup_summary(load_config(None, overrides))
    assert said in line and "rewards 1x(1 CPU)" in line, line


def test_the_start_up_line_of_environment_scores_lists_no_reward_pool():
    from cluster.runtime.service import startup_summary

    line = startup_summary(load_config(None, ENV))
    assert "| reward the environment's | episodes of cluster.demo.arithmetic:SecondChance, up to 4 turns |" in line
    assert "rewards" not in line, line

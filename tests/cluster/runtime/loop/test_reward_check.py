"""A step whose share of invalid scores is above reward.max_invalid_fraction stops the run."""
import pytest

from cluster.config.ppo import ConfigError, load_config
from cluster.runtime.observe.produced import Produced

pytestmark = pytest.mark.unit


def check(produced, *overrides, step=3):
    from cluster.runtime.loop.reward_check import check_invalid_scores
    check_invalid_scores(produced, load_config(None, list(overrides)), step)


def test_a_share_at_or_below_the_threshold_passes():
    check(Produced(stored=32, invalid_scores=32))  # half, the default threshold
    check(Produced(stored=0, invalid_scores=0, skipped_prompts=16))  # nothing scored: not the reward's doing
    check(Produced(stored=1, invalid_scores=63), "reward.max_invalid_fraction=1")


def test_a_share_above_it_names_the_reward_function():
    from cluster.runtime.loop.reward_check import InvalidScores
    with pytest.raises(InvalidScores) as e:
        check(Produced(stored=20, invalid_scores=40, empty_responses=4))
    assert str(e.value) == (
        "reward function cluster.demo.sentiment:sentiment: 40 of 64 scores at step 3 were invalid (NaN or inf, "
        "or the reward raised; the log's 'reward:' lines say why), above reward.max_invalid_fraction=0.5; fix the "
        "reward, or raise reward.max_invalid_fraction to train on the rest")


def test_a_reward_model_is_named_by_its_path(tmp_path):
    from cluster.runtime.loop.reward_check import InvalidScores
    with pytest.raises(InvalidScores, match=f"^reward model {tmp_path}: 64 of 64 scores at step 3"):
        check(Produced(invalid_scores=64), "reward.function=null", f"reward.model={tmp_path}")


def test_a_judge_is_named_by_its_model():
    from cluster.runtime.loop.reward_check import InvalidScores
    with pytest.raises(InvalidScores, match="^reward judge builtin:judge: 64 of 64 scores at step 3"):
        check(Produced(invalid_scores=64), "reward.function=null", "reward.judge.model=builtin:judge")


ENV = ["env.environment=cluster.demo.arithmetic:SecondChance", "env.step_timeout_s=10"]
# Every episode failed: per round, the one worker's first step hung past the timeout and the
# seven episodes queued on it were lost with it (actors/environments/workers.py counts each).
HUNG = Produced(invalid_scores=64, episode_counts={"episodes": 64, "invalid": 64, "timeouts": 8, "lost": 56})


def test_episodes_the_environment_failed_name_the_environment_and_how_they_failed():
    from cluster.runtime.loop.reward_check import InvalidScores
    with pytest.raises(InvalidScores) as e:
        check(HUNG, *ENV, step=1)
    assert str(e.value) == (
        "environment cluster.demo.arithmetic:SecondChance: 64 of 64 episodes at step 1 were invalid (64 episodes "
        "failed: 8 timed out past env.step_timeout_s=10 s, 56 lost with a worker that failed another episode; the "
        "log's 'reward:' lines say why), above reward.max_invalid_fraction=0.5; fix the environment, raise "
        "env.step_timeout_s, or raise reward.max_invalid_fraction to train on the rest")


def test_a_pool_scoring_episodes_names_its_reward_and_the_failed_episodes():
    from cluster.runtime.loop.reward_check import InvalidScores
    with pytest.raises(InvalidScores, match=r"^reward function cluster.demo.sentiment:sentiment: 64 of 64 scores at "
                                            r"step 2 .*why; 64 episodes failed: 8 timed out past env.step_timeout_s="
                                            r"10 s, 56 lost .* in env.environment cluster.demo.arithmetic:"
                                            r"SecondChance\)"):
        check(HUNG, *ENV, "env.reward=pool", step=2)


@pytest.mark.parametrize("value", ["-0.1", "1.5"])
def test_the_threshold_is_a_fraction(value):
    with pytest.raises(ConfigError, match=f"reward.max_invalid_fraction={float(value)} must be in"):
        load_config(None, [f"reward.max_invalid_fraction={value}"])

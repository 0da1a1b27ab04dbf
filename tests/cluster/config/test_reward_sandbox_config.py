"""reward.sandbox: its keys load from the command line, and impossible values are one line naming the key."""
import pytest

from cluster.config.ppo import ConfigError, load_config

pytestmark = pytest.mark.unit


def test_the_sandbox_is_off_by_default_and_its_keys_load():
    assert load_config().reward.sandbox.workers == 0
    cfg = load_config(overrides=["reward.sandbox.workers=2", "reward.sandbox.timeout_s=1.5",
                                 "reward.sandbox.memory_mb=1024"])
    assert (cfg.reward.sandbox.workers, cfg.reward.sandbox.timeout_s, cfg.reward.sandbox.memory_mb) == (2, 1.5, 1024)


@pytest.mark.parametrize("override, key", [("reward.sandbox.workers=-1", "reward.sandbox.workers=-1"),
                                           ("reward.sandbox.timeout_s=0", "reward.sandbox.timeout_s=0"),
                                           ("reward.sandbox.memory_mb=-5", "reward.sandbox.memory_mb=-5")])
def test_impossible_values_are_one_line(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    assert key in str(e.value) and "\n" not in str(e.value)

"""The teacher section: off by default; its coefficient reaches the learner; settings no run
could use are one line naming the key."""
import pytest

from cluster.config.ppo import load_config
from core.infra.schema import ConfigError

pytestmark = pytest.mark.unit


def test_no_teacher_by_default_and_its_coefficient_reaches_the_learner():
    assert load_config(None, []).learner_config().teacher_coef == 0.0
    cfg = load_config(None, ["teacher.model=builtin:tiny", "teacher.coef=0.5"])
    cfg.validate()
    assert cfg.learner_config().teacher_coef == 0.5


@pytest.mark.parametrize("overrides, says", [
    (["teacher.coef=0"], "teacher.coef=0.0 must be a finite number > 0"),
    (["teacher.coef=-1"], "teacher.coef=-1.0"),
    (["reference.on_learner=true", "learner.lora.rank=4"], "set reference.on_learner=false")])
def test_settings_a_teacher_cannot_run_with_are_one_line(overrides, says):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["teacher.model=builtin:tiny", *overrides]).validate()
    assert says in str(e.value) and "\n" not in str(e.value)


def test_with_a_teacher_the_reward_may_be_absent_or_monitors_only_without_one_neither():
    load_config(None, ["reward.function=null", "teacher.model=builtin:tiny"]).validate()
    monitors = ['reward.sources=[{name: s, function: "cluster.demo.sentiment:sentiment", weight: 0}]',
                "reward.function=null"]
    load_config(None, [*monitors, "teacher.model=builtin:tiny"]).validate()
    with pytest.raises(ConfigError, match="set exactly one of"):
        load_config(None, ["reward.function=null"]).validate()
    with pytest.raises(ConfigError, match="no trainable weight.*or set teacher.model"):
        load_config(None, monitors).validate()

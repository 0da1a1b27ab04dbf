"""prepare() checks the reward the run calls (cluster/runtime/prepare.py): with env.reward=environment
the reward.* function is neither imported nor probed, since the run never calls it."""
import pytest

from actors.rewards.config import BUILTIN_REWARD
from cluster.config.ppo import load_config
from cluster.runtime.prepare import prepare

pytestmark = pytest.mark.integration
ENV = ["env.environment=actors.environments:Calculator"]


def test_the_environment_scoring_loads_and_probes_no_reward_function(monkeypatch):
    import actors.rewards.probe
    import actors.rewards.scoring

    calls = []

    def counting(name, real):
        def counted(spec, *args, **kwargs):
            calls.append((name, spec))
            return real(spec, *args, **kwargs)
        return counted

    for module, name in ((actors.rewards.scoring, "load_function"), (actors.rewards.probe, "probe_function")):
        monkeypatch.setattr(module, name, counting(name, getattr(module, name)))
    prepare(load_config(None, ENV))
    assert calls == []
    prepare(load_config(None, ENV + ["env.reward=pool"]))  # the pool calls it: loaded and probed
    assert set(calls) == {("load_function", BUILTIN_REWARD), ("probe_function", BUILTIN_REWARD)}

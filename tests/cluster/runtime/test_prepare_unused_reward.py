"""prepare() checks the reward the run calls (cluster/runtime/prepare.py): with env.reward=environment
the reward.* function is neither imported nor probed, since the run never calls it."""
import pytest

from cluster.config.ppo import BUILTIN_REWARD, load_config
from cluster.runtime.prepare import prepare

pytestmark = pytest.mark.integration
ENV = ["env.environment=actors.environments:Calculator"]


def test_the_environment_scoring_loads_and_probes_no_reward_function(monkeypatch):
    import actors.reward

    calls = []

    def counting(name, real):
        def counted(spec, *args, **kwargs):
            calls.append((name, spec))
            return real(spec, *args, **kwargs)
        return counted

    for name in ("load_function", "probe_function"):
        monkeypatch.setattr(actors.reward, name, counting(name, getattr(actors.reward, name)))
    prepare(load_config(None, ENV))
    assert calls == []
    prepare(load_config(None, ENV + ["env.reward=pool"]))  # the pool calls it: loaded and probed
    assert set(calls) == {("load_function", BUILTIN_REWARD), ("probe_function", BUILTIN_REWARD)}

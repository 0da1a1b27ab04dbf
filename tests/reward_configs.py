"""RewardConfig for a test's reward replica, written as the config's keys: ``reward_config(model=path)``,
``reward_config(function="mod:fn", sandbox={"workers": 2, ...})``. Unlike the config file's
default, no reward function is set unless given."""
from actors.rewards.config import JudgeConfig, RewardConfig, RewardHTTPConfig, SandboxConfig
from core.modeling.engine_config import EngineConfig

SECTIONS = {"http": RewardHTTPConfig, "sandbox": SandboxConfig}


def reward_config(**settings) -> RewardConfig:
    for key, cls in SECTIONS.items():
        if isinstance(settings.get(key), dict):
            settings[key] = cls(**settings[key])
    judge = settings.get("judge")
    if isinstance(judge, dict):
        engine = judge.get("engine")
        settings["judge"] = JudgeConfig(**{**judge, "engine": EngineConfig(**engine) if isinstance(engine, dict)
                                           else engine or EngineConfig()})
    return RewardConfig(**{"function": None, **settings})

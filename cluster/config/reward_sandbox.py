"""reward.sandbox: a reward function (and reward.gold) scored in worker processes (actors/sandbox.py)."""
from __future__ import annotations

from cluster.config.loader import ConfigError
from core.infra.schema import config_class, setting


@config_class
class SandboxConfig:
    """Run reward.function and reward.gold in worker processes: a pair that hangs, crashes or eats memory is invalid"""
    workers: int = setting(0, "worker processes per reward replica, each scoring one pair at a time; 0 = off "
                              "(the function runs in the replica, limited by reward.timeout_s per call)")
    timeout_s: float = setting(10.0, "a pair not scored after this many seconds is invalid; its worker is killed "
                                     "and replaced")
    memory_mb: int = setting(0, "cap on each worker's data segment (heap and anonymous memory, RLIMIT_DATA; the "
                                "interpreter and the function's imports count too), in MiB: past it an allocation "
                                "fails and that pair is invalid; 0 = no cap")


def check_sandbox(sandbox: SandboxConfig) -> None:
    """One line naming the key, for settings no sandbox can run with."""
    if sandbox.workers < 0 or not sandbox.timeout_s > 0 or sandbox.memory_mb < 0:
        raise ConfigError(f"config: reward.sandbox.workers={sandbox.workers} must be >= 0 (0 = off), "
                          f"reward.sandbox.timeout_s={sandbox.timeout_s} > 0 and reward.sandbox.memory_mb="
                          f"{sandbox.memory_mb} >= 0 (0 = no cap)")

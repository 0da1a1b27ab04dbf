"""Fixtures shared by the fault tests."""
import os
from pathlib import Path

import pytest
import ray

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def cluster():
    """A local Ray for the module's in-process runs (logical CPUs: several pools on 2 cores)."""
    ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def cluster_with_test_rewards():
    """A Ray cluster whose workers can import tests/e2e/slow_reward.py (PYTHONPATH is
    inherited by the workers, so it is set before ray.init)."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), old) if p)
    ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()
    if old is None:
        os.environ.pop("PYTHONPATH")
    else:
        os.environ["PYTHONPATH"] = old

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


# The folder where the test rewards and environments (slow_reward.py, episode_envs.py) leave
# their marks: named in the environment, which Ray's workers and their subprocesses inherit.
MARKS_VAR = "TETHER_TEST_MARKS"


@pytest.fixture(scope="module")
def cluster_with_test_rewards(tmp_path_factory):
    """A Ray cluster whose workers can import tests/e2e/slow_reward.py and leave marks in a
    folder of this module's own (PYTHONPATH and $TETHER_TEST_MARKS are inherited by the
    workers, so they are set before ray.init). Yields the marks folder."""
    marks = tmp_path_factory.mktemp("marks")
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", MARKS_VAR)}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), saved["PYTHONPATH"]) if p)
    os.environ[MARKS_VAR] = str(marks)
    try:
        ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="WARNING")
        yield marks
        ray.shutdown()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

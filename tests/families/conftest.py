"""Fixtures of the model-family tests; the learner tests' plain helpers (synthetic rollouts, SGD
configs) are importable here too, as `helpers` (pyproject.toml's pythonpath)."""
import pytest


@pytest.fixture(scope="module")
def ray_local():
    import ray

    # Logical CPUs: a generator and two learner ranks (ZeRO-2, ZeRO-3) loading at once.
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def cluster():
    """A local Ray with room for a whole PPO job's pools (the three-step family runs)."""
    import ray
    ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()

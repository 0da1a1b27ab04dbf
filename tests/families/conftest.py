import os
import sys

import pytest

# The learner tests' plain helpers (synthetic rollouts, SGD configs): test dirs have no __init__.py.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "learner"))


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()

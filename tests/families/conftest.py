"""Fixtures of the model-family tests; the learner tests' plain helpers (synthetic rollouts, SGD
configs) are importable here too, as `helpers` (pyproject.toml's pythonpath)."""
import pytest


@pytest.fixture(scope="module")
def ray_local():
    """The session's shared local Ray (tests/rays.py): room for a generator and two learner ranks."""
    import rays
    rays.shared()


@pytest.fixture(scope="module")
def cluster():
    """The shared Ray, with room for a whole PPO job's pools (the three-step family runs)."""
    import rays
    rays.shared()

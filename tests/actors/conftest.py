import pytest


@pytest.fixture(scope="module")
def ray_cluster():
    """The session's shared local Ray (tests/rays.py); nothing a test starts outlives it
    (tests/conftest.py checks)."""
    import ray
    import rays

    rays.shared()
    return ray

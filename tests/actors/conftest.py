import pytest


@pytest.fixture(scope="module")
def ray_cluster():
    """A small local Ray cluster per test module (each module's actors start clean)."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield ray
    ray.shutdown()

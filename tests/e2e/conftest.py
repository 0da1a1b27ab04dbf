"""Fixtures shared by the whole-service tests."""
import shutil

import pytest
import rays


@pytest.fixture(scope="module")
def cluster():
    """The session's shared local Ray (tests/rays.py) for the module's in-process runs."""
    rays.shared()


@pytest.fixture(scope="module")
def cluster_with_test_rewards():
    """The shared Ray, whose workers import tests/e2e's rewards and environments (slow_reward.py,
    episode_envs.py) and leave marks in the folder $TETHER_TEST_MARKS names. Yields that folder,
    emptied after the module: the next module's marks start from nothing."""
    marks = rays.shared()
    yield marks
    for path in marks.iterdir():
        shutil.rmtree(path) if path.is_dir() else path.unlink()

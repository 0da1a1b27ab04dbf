"""Fixtures shared by the learner tests; helpers.py holds plain functions."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # test dirs have no __init__.py: import helpers directly


@pytest.fixture(scope="session")
def pad_id(policy_path):
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(policy_path).pad_token_id


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray for one test module (GPUs are detected: the GPU tier uses it too)."""
    import ray
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()

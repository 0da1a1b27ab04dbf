"""Fixtures shared by the learner tests; helpers.py holds plain functions."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # test dirs have no __init__.py: import helpers directly


@pytest.fixture(scope="session")
def policy_path():
    from cluster.tiny_models import build_policy
    return str(build_policy())


@pytest.fixture(scope="session")
def reward_path():
    from cluster.tiny_models import build_reward_model
    return str(build_reward_model())


@pytest.fixture(scope="session")
def pad_id(policy_path):
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(policy_path).pad_token_id

import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="gpu tier: no CUDA device on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Tiny offline models (cached on disk by content): one build serves every test session.
@pytest.fixture(scope="session")
def policy_path():
    from cluster.tiny_models import build_policy
    return str(build_policy())


@pytest.fixture(scope="session")
def reward_path():
    from cluster.tiny_models import build_reward_model
    return str(build_reward_model())


@pytest.fixture(scope="session")
def tokenizer(policy_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(policy_path)


@pytest.fixture(scope="session")
def entrypoints():
    """`python -m <module> ...` in forked children of one process that imported the stack once
    (tests/entrypoints.py): the user-mistake cases cost milliseconds instead of ~6 s each."""
    from entrypoints import EntrypointServer

    server = EntrypointServer()
    yield server
    server.close()

"""A pre-trained tiny model's bits do not depend on the process that asks for it: vLLM's CPU
worker replaces torch.set_num_threads with a no-op once it has bound its threads, and a build in
such a process used to run on every core, giving another model (the arithmetic policy of one
test-suite run answered 15% of its prompts right instead of 29%, and three learning tests
failed). Builds run in a fresh interpreter on one thread (cluster.demo.tiny_models.run_apart)."""
import hashlib

import pytest
import torch

from cluster.demo.pretrain import build_pretrained_policy

pytestmark = pytest.mark.integration


def _digest(path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.timeout(300)
def test_a_build_after_vllm_disabled_set_num_threads_is_the_clean_build(tmp_path, monkeypatch):
    monkeypatch.setenv("TETHER_CACHE", str(tmp_path / "clean"))
    clean = _digest(build_pretrained_policy(steps=30))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # what vLLM's CPU worker leaves behind
    monkeypatch.setenv("TETHER_CACHE", str(tmp_path / "after-vllm"))
    try:
        assert _digest(build_pretrained_policy(steps=30)) == clean
    finally:
        monkeypatch.undo()
        torch.set_num_threads(threads)

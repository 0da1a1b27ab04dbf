"""A Hub dataset id through the real entrypoint, offline: `python -m cluster.train` in a fresh
interpreter with HF_HOME in a tmp folder and HF_HUB_OFFLINE=1 (datasets reads both at import,
so these run as subprocesses). None of them starts Ray: the data is read in prepare()."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from entrypoints import assert_one_line_error
from hub_cache import cache_hub_dataset

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    pytest.importorskip("datasets")
    home = tmp_path_factory.mktemp("hf-home")
    questions = [f"Question {i}: how many apples" for i in range(40)]
    cache_hub_dataset(home / "datasets", "openai/gsm8k", "main",
                      {"train": {"question": questions, "answer": ["1"] * 40},
                       "test": {"question": questions[:3], "answer": ["1"] * 3}})
    return home


def _train(hf_home: Path, run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_DATASETS_CACHE", "HF_DATASETS_OFFLINE")}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", RAY_ADDRESS="")
    return subprocess.run([sys.executable, "-m", "cluster.train", f"run.dir={run_dir}", *args], cwd=REPO,
                          text=True, capture_output=True, timeout=300, env=env)


def test_not_cached_offline_exits_2_with_one_line(hf_home, tmp_path):
    result = _train(hf_home, tmp_path / "runs", "data.path=someone/not-cached")
    assert_one_line_error(result, tmp_path / "runs", "data.path 'someone/not-cached' (split 'train') is not in the "
                          "local datasets cache and the Hub cannot be reached (offline); download it once with "
                          "network access, or point data.path at a local file")


def test_cached_id_is_read_and_a_wrong_split_is_named(hf_home, tmp_path):
    # Read: its 40 prompts are counted against prompts_per_step (a check made after loading).
    result = _train(hf_home, tmp_path / "runs", "data.path=openai/gsm8k", "data.config_name=main",
                    "data.field=question", "data.eval_prompts=4", "data.prompts_per_step=64")
    assert_one_line_error(result, tmp_path / "runs", "data: 36 training prompts in openai/gsm8k (after holding out "
                          "data.eval_prompts=4) are fewer than data.prompts_per_step=64")
    result = _train(hf_home, tmp_path / "runs", "data.path=openai/gsm8k", "data.config_name=main",
                    "data.field=question", "data.split=validation")
    assert_one_line_error(result, tmp_path / "runs", "data.split='validation' is not a split of 'openai/gsm8k'; "
                          "available: train, test; set data.split to one of them")

"""builtin:arith (cluster/demo/arithmetic.py): the arithmetic task's policy and prompt rows by name,
built on first use into the cache and found there after, so its configs run as a first command."""
import json

import pytest

from cluster.config.ppo import CONFIGS, load_config
from cluster.demo import arithmetic
from cluster.job.errors import UserError


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TETHER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.unit
def test_the_prompt_rows_are_written_once_into_the_cache(empty_cache, monkeypatch):
    from cluster.runtime.prepare import resolve_data

    path = resolve_data(arithmetic.BUILTIN)
    assert path.startswith(str(empty_cache))
    assert [json.loads(line) for line in open(path)] == arithmetic.prompt_rows()
    monkeypatch.setattr("core.infra.files.publish_dir", None)  # a second build would fail here
    assert resolve_data(arithmetic.BUILTIN) == path
    assert not [p for p in empty_cache.iterdir() if p.name.startswith(".")]  # no temp folder left behind


@pytest.mark.unit
def test_other_data_paths_pass_and_an_unknown_builtin_is_one_line():
    from cluster.runtime.prepare import resolve_data

    assert resolve_data(None) is None and resolve_data("rows.jsonl") == "rows.jsonl"
    with pytest.raises(UserError, match=r"^data.path='builtin:math' is not a built-in prompt set; use builtin:arith"):
        resolve_data("builtin:math")


@pytest.mark.unit
@pytest.mark.parametrize("name", ["arith-tiny.yaml", "arith-episodes-tiny.yaml"])
def test_the_task_configs_name_only_built_in_inputs(name):
    cfg = load_config(CONFIGS / name)
    cfg.validate()
    assert (cfg.model.policy, cfg.data.path) == (arithmetic.BUILTIN, arithmetic.BUILTIN)


@pytest.mark.integration
def test_the_policy_is_built_once_into_the_cache(empty_cache, monkeypatch):
    """A few pre-training steps stand in for the task's 1000: the cache key covers them."""
    from cluster.demo import pretrain
    from cluster.runtime.state.models import resolve_model

    monkeypatch.setattr(arithmetic, "PRETRAIN_STEPS", 2)
    builds = []
    real = pretrain._pretrain_apart
    monkeypatch.setattr(pretrain, "_pretrain_apart", lambda *a, **k: (builds.append(a[1]), real(*a, **k)))
    path = resolve_model(arithmetic.BUILTIN)
    assert path.startswith(str(empty_cache)) and len(builds) == 1
    assert json.loads(open(f"{path}/pretrain.json").read())["steps"] == 2
    assert resolve_model(arithmetic.BUILTIN) == path and len(builds) == 1  # found, not built again

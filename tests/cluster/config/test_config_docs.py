"""The config as data: every key has help text, docs/config.md is what the metadata generates,
choices are checked in one place, and importing the config pulls in no heavy library."""
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.config import docs
from cluster.config.loader import ConfigError, walk
from core.infra.schema import check_choices, help_of

REPO = Path(__file__).resolve().parents[3]


def _all_keys():
    from learner.config import LearnerConfig

    for _, _, root in docs.ROOTS:
        yield from walk(root)
    yield from walk(LearnerConfig, "learner.")  # what a learner rank gets, beyond the learner section


@pytest.mark.unit
def test_docs_config_md_is_generated_from_the_metadata():
    assert docs.DOCS.read_text() == docs.render(), f"docs/config.md is stale; regenerate it with {docs.COMMAND}"


@pytest.mark.unit
def test_every_key_has_help():
    missing = sorted({path for path, f, _ in _all_keys() if not help_of(f).strip()})
    assert not missing, f"config keys without help text (give them setting(default, help)): {missing}"


@pytest.mark.unit
def test_help_config_lists_every_key_with_its_help():
    from cluster.config.ppo import describe

    text = describe()
    for path, f, tp in walk(docs.ROOTS[0][2]):
        if not dataclasses.is_dataclass(tp):
            assert f"\n{path} = " in f"\n{text}" and help_of(f) in text
    assert "run.mode = 'sync'    # sync (on-policy) | async (bounded staleness)" in text
    assert "learner.optim.optimizer = 'adamw'" in text


@pytest.mark.unit
def test_choices_are_checked_alike_everywhere():
    from cluster.config.pipeline import PipelineConfig
    from cluster.config.stages import load_stage_config
    from learner.config import LearnerConfig, PPOConfig

    with pytest.raises(ConfigError, match=r"^config: pairs\.labels='soft' is unknown; use one of hard, bradley_terry$"):
        load_stage_config(PipelineConfig, None, ["pairs.labels=soft"])
    with pytest.raises(ValueError, match=r"^learner\.ppo\.old_logprobs='vllm' is unknown; use one of recompute, "):
        LearnerConfig(ppo=PPOConfig(old_logprobs="vllm")).validate(1)
    check_choices(LearnerConfig(critic=None), "learner")  # None passes where the type is Optional


@pytest.mark.integration
def test_importing_the_config_imports_no_heavy_library():
    modules = [p.stem for p in (REPO / "cluster" / "config").glob("*.py") if p.stem != "__init__"]
    code = ("import sys\n" + "".join(f"import cluster.config.{m}\n" for m in modules)
            + "print(sorted(m for m in ('torch', 'vllm', 'transformers', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing cluster.config pulls in {out.stdout.strip()}"

"""The installed ``tether`` command: its subcommands, --help, and a mistake in one line."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cli import SUBCOMMANDS

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[3]
TETHER = Path(sys.executable).with_name("tether")  # where `pip install -e .` put the console script


def tether(*args: str) -> subprocess.CompletedProcess:
    if not TETHER.is_file():
        pytest.fail(f"{TETHER} is missing: install the project (scripts/setup.sh, or pip install -e . --no-deps)")
    return subprocess.run([str(TETHER), *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_help_lists_every_subcommand_with_one_line():
    result = tether("--help")
    assert result.returncode == 0 and result.stderr == ""
    listed = {ln.split()[0]: ln for ln in result.stdout.splitlines() if ln.startswith("  ")}
    assert list(listed) == list(SUBCOMMANDS)
    assert all(listed[name].endswith(what) for name, (_, what) in SUBCOMMANDS.items())


def test_train_help_is_the_entrypoints():
    result = tether("train", "--help")
    assert result.returncode == 0, result.stderr
    assert "--help-config" in result.stdout and "Job entrypoint" in result.stdout
    assert result.stdout.startswith("usage: tether train "), result.stdout[:200]


@pytest.mark.parametrize("name", ["sft", "sweep", "scale", "cluster"])
def test_each_subcommands_help_names_the_command_typed(name):
    result = tether(name, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: tether {name} "), result.stdout[:200]


def test_unknown_subcommand_names_the_valid_ones_and_exits_2():
    result = tether("trian")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "tether: error: unknown subcommand 'trian'; choose one of train, sft, reward-model, pipeline, sweep, scale, "
        "cluster"]

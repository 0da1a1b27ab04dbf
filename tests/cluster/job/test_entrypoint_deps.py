"""The entrypoint run by a Python without the stack (e.g. `ray job submit` to a Ray started
outside .venv) ends with one line naming what is missing and exit 2, not a traceback."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.job.command import missing_dependencies

REPO = Path(__file__).resolve().parents[3]
# The probe: Python >= 3.9 (parses cluster/train.py) and no importable torch.
PROBE = ("import importlib.util, sys; "
         "sys.exit(0 if sys.version_info >= (3, 9) and importlib.util.find_spec('torch') is None else 1)")


def _clean_env() -> dict:
    """The environment without the venv: what a shell without .venv on PATH passes on."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    venv_bin = str(Path(sys.prefix) / "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    return env


def _python_without_torch() -> str | None:
    candidates = [getattr(sys, "_base_executable", None), shutil.which("python3", path=_clean_env()["PATH"]),
                  "/usr/bin/python3", "/usr/local/bin/python3"]
    seen = set()
    for exe in candidates:
        if not exe or not os.path.isfile(exe) or os.path.realpath(exe) in seen:
            continue
        seen.add(os.path.realpath(exe))
        try:
            probe = subprocess.run([exe, "-c", PROBE], env=_clean_env(), cwd="/", capture_output=True,
                                   timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return exe
    return None


@pytest.mark.unit
def test_missing_dependencies_empty_in_project_env():
    assert missing_dependencies() == []


@pytest.mark.integration
def test_entrypoint_without_torch_is_one_line():
    python = _python_without_torch()
    if python is None:
        pytest.skip("no Python >= 3.9 without torch on this machine (base interpreter, python3 on "
                    "PATH outside the venv, /usr/bin/python3, /usr/local/bin/python3)")
    result = subprocess.run([python, "-m", "cluster.train", "--config", "configs/tiny-cpu.yaml"],
                            cwd=REPO, env=_clean_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("tether: error: this Python (")
    assert "torch" in line and "On a Ray cluster" in line
    assert "Traceback" not in result.stderr and result.stdout == ""

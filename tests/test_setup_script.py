"""scripts/setup.sh refuses an unusable Python with one line, before touching anything."""
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # runs scripts/setup.sh in bash
REPO = Path(__file__).resolve().parents[1]


def run_setup(python: str):
    return subprocess.run(["bash", "scripts/setup.sh"], cwd=REPO, text=True, capture_output=True,
                          env={**os.environ, "PYTHON": python}, timeout=60)


def test_missing_python_is_one_line():
    result = run_setup("/nonexistent/python3.11")
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0
    assert "needs Python >= 3.11" in result.stderr and "PYTHON=" in result.stderr


def test_old_python_is_one_line(tmp_path):
    fake = tmp_path / "python3.9"
    fake.write_text("#!/bin/sh\n# a Python 3.9 stand-in: fails the version check\nexit 1\n")
    fake.chmod(0o755)
    result = run_setup(str(fake))
    assert result.returncode == 1
    assert "needs Python >= 3.11" in result.stderr
    assert result.stderr.strip().count("\n") == 0

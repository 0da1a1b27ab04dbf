"""scripts/setup.sh refuses an unusable Python with one line, before touching anything; its stamp
records the stack it installed (cpu or gpu), so a .venv moved to the other kind of machine is re-installed."""
import os
import shutil
import subprocess
import sys
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


def fake_command(bin_dir: Path, name: str, body: str) -> None:
    (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
    (bin_dir / name).chmod(0o755)


def test_the_stamp_records_the_stack_so_a_switch_reinstalls(tmp_path):
    """A copy of the repository's set-up inputs, a .venv whose python records its pip calls."""
    repo, bin_dir = tmp_path / "repo", tmp_path / "bin"
    for f in ("pyproject.toml", "scripts/setup.sh", "constraints/cpu.txt", "constraints/gpu.txt"):
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / f, repo / f)
    (repo / ".venv" / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    calls = tmp_path / "pip-calls"
    fake_command(repo / ".venv" / "bin", "python", f'echo "$*" >> {calls}')
    fake_command(bin_dir, "apt-get", "exit 1")  # never install chromium from a test
    path = [str(bin_dir)] + [d for d in os.environ["PATH"].split(os.pathsep)
                             if d and not (Path(d) / "nvidia-smi").exists()]

    def setup():
        result = subprocess.run(["bash", "scripts/setup.sh"], cwd=repo, text=True, capture_output=True, timeout=60,
                                env={**os.environ, "PYTHON": sys.executable, "PATH": os.pathsep.join(path)})
        assert result.returncode == 0, result.stderr
        installed = calls.read_text() if calls.exists() else ""
        calls.unlink(missing_ok=True)
        return installed, (repo / ".venv" / ".tether-installed").read_text()

    installed, stamp = setup()
    assert "constraints/cpu.txt" in installed and stamp.startswith("cpu ")
    assert setup()[0] == ""  # the same stack again: nothing installed
    fake_command(bin_dir, "nvidia-smi", 'echo "GPU 0: Fake GPU (UUID: GPU-0)"')
    installed, stamp = setup()
    assert "constraints/gpu.txt" in installed and stamp.startswith("gpu ")
    (bin_dir / "nvidia-smi").unlink()
    assert "constraints/cpu.txt" in setup()[0]  # and back

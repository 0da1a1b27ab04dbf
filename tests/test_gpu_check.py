"""scripts/gpu-check.sh on a machine without an NVIDIA GPU: one line, exit code 3, nothing installed."""
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # runs scripts/gpu-check.sh in bash
REPO = Path(__file__).resolve().parents[1]
NO_GPU = ("gpu-check: no NVIDIA GPU on this machine (nvidia-smi lists none); "
          "run this on a machine with at least one")


def path_without_nvidia_smi() -> list[str]:
    return [d for d in os.environ["PATH"].split(os.pathsep) if d and not (Path(d) / "nvidia-smi").exists()]


def run_check(path: list[str]):
    return subprocess.run(["bash", "scripts/gpu-check.sh"], cwd=REPO, text=True, capture_output=True,
                          env={**os.environ, "PATH": os.pathsep.join(path)}, timeout=60)


def fake_nvidia_smi(tmp_path: Path, body: str) -> list[str]:
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\n{body}\n")
    fake.chmod(0o755)
    return [str(tmp_path), *path_without_nvidia_smi()]


@pytest.mark.parametrize("setup", ["absent", "lists none", "fails"])
def test_no_gpu_is_one_line_and_exit_3(tmp_path, setup):
    path = {"absent": path_without_nvidia_smi,
            "lists none": lambda: fake_nvidia_smi(tmp_path, "exit 0"),
            "fails": lambda: fake_nvidia_smi(tmp_path, "echo 'NVIDIA-SMI has failed' >&2; exit 9")}[setup]()
    result = run_check(path)
    assert result.returncode == 3
    assert result.stderr == NO_GPU + "\n" and result.stdout == ""

"""scripts/gpu-check.sh on a machine without an NVIDIA GPU: one line, exit code 3, nothing installed;
and the GPU scripts' pytest runs fail (exit 6) when every gpu test skipped."""
import os
import subprocess
import sys
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


def cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def run_pytest(*args):
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", "--require-passed",
                           *args], cwd=REPO, text=True, capture_output=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.skipif(cuda_available(), reason="CUDA is usable here: the gpu tests run")
def test_a_gpu_run_whose_every_test_skipped_is_not_a_pass():
    result = run_pytest("-m", "gpu", "tests/learner/test_gpu_update.py")
    assert result.returncode == 6, result.stdout[-2000:]
    assert "--require-passed: no test passed (every selected test was skipped), exit 6" in result.stdout
    passed = run_pytest(
        "tests/cluster/runtime/loop/test_reward_check.py::test_a_share_at_or_below_the_threshold_passes")
    assert passed.returncode == 0, passed.stdout[-2000:]


@pytest.mark.parametrize("script", ["gpu-check.sh", "gpu-learner-check.sh"])
def test_the_gpu_scripts_require_a_passed_test(script):
    text = (REPO / "scripts" / script).read_text()
    runs = [line for line in text.splitlines() if "-m pytest" in line and "-m gpu" in line]
    assert runs and all("--require-passed" in line for line in runs)
    assert "; 6 " in text  # the exit codes in the header say what 6 means

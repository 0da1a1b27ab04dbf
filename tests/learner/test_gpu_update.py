"""GPU tier: one learner rank's PPO update on CUDA (DeepSpeed ZeRO-2 and -3, fp32, SGD) gives the
weights of the plain single-process torch update on the CPU. The agreement metrics once summed
CPU tensors into CUDA ones, so every CUDA update failed at its first train(); this runs the
whole update there. `scripts/gpu-check.sh` and `scripts/gpu-learner-check.sh` run this tier."""
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import make_rollouts, max_abs_diff, reference_update, sgd_config

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TOL = 1e-4  # CUDA and CPU kernels sum in different orders (fp32; measured on the CPU alone: ~4e-7)


@pytest.mark.integration
@pytest.mark.gpu
@pytest.mark.parametrize("stage", [2, 3])
def test_cuda_update_matches_plain_torch(policy_path, pad_id, tmp_path, stage):
    rollouts = make_rollouts(policy_path, 8, seed=1)
    cfg = sgd_config(zero_stage=stage)
    expected, _ = reference_update(policy_path, rollouts, cfg, pad_id)
    (tmp_path / "in.pkl").write_bytes(pickle.dumps((policy_path, rollouts, cfg)))
    env = {**os.environ, "DS_ACCELERATOR": "cuda",
           "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
    proc = subprocess.run([sys.executable, str(HERE / "gpu_update_child.py"), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = torch.load(tmp_path / "out.pt")
    initial = {k: v for k, v in reference_update(policy_path, rollouts, sgd_config(zero_stage=stage, lr=0.0),
                                                 pad_id)[0].items()}
    assert max_abs_diff(initial, expected) > 1e-3  # the update moves the weights
    assert max_abs_diff(out["weights"], expected) < TOL
    assert all(math.isfinite(v) for v in out["metrics"].values() if isinstance(v, float))

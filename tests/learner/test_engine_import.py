"""A learner rank imports and initialises DeepSpeed without the optional modules it never uses:
MLflow (the autotuner's, ~40% of DeepSpeed's import with the trackers extra installed) and the
Muon optimizer (initialize's optimizer check imports it, and its import torch.compiles kernels,
loading inductor's compiler). Both import as ever afterwards. Measured side by side on the 2-core
machine: building a tiny rank took 4.9 s of CPU before, 2.9 s after."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

PROBE = """
import os, sys
os.environ["DS_ACCELERATOR"] = "cpu"
from cluster.demo.tiny_models import build_policy
from learner.config import LearnerConfig
from learner.engine import build_engine, import_deepspeed
from learner.objectives.ppo import PPOObjective
from learner.worker import LearnerWorker
ds = import_deepspeed()
from deepspeed.autotuning import autotuner
assert "mlflow" not in sys.modules, "deepspeed's import loaded mlflow"
assert autotuner.has_mlflow is False
assert import_deepspeed() is ds
worker = LearnerWorker(rank=0, world_size=1, model=str(build_policy()), config={"zero_stage": 2})
assert worker.engine is not None
assert "deepspeed.runtime.zero.muon.muon_optimizer" not in sys.modules
assert "torch._inductor.compile_fx" not in sys.modules, "something compiled"
# bf16 below ZeRO-2 and ZeRO-3 build optimizers that import Muon unguarded: those still build
for config in ({"zero_stage": 0, "dtype": "bfloat16"}, {"zero_stage": 3}):
    assert LearnerWorker(rank=0, world_size=1, model=str(build_policy()), config=config).engine is not None
import mlflow  # the marks are gone: a tracker in this process still gets it
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
print("ok")
"""


@pytest.mark.timeout(180)
def test_deepspeed_imports_and_initialises_without_unused_optional_modules(policy_path):
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=170)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]

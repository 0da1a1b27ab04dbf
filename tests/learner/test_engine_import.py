"""A learner rank imports DeepSpeed without MLflow (its autotuner's optional import, ~40% of
DeepSpeed's import time with the trackers extra installed), and MLflow stays importable after."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

PROBE = """
import sys
from learner.engine import import_deepspeed
ds = import_deepspeed()
from deepspeed.autotuning import autotuner
assert "mlflow" not in sys.modules, "deepspeed's import loaded mlflow"
assert autotuner.has_mlflow is False
assert import_deepspeed() is ds
import mlflow  # the mark is gone: a tracker in this process still gets it
print("ok")
"""


@pytest.mark.timeout(120)
def test_deepspeed_imports_without_mlflow_and_mlflow_still_imports_after():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]

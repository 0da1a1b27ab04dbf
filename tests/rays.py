"""One local Ray for the whole test session, started by the first module that needs it and left
running for the next: a Ray start and shutdown per module cost seconds each, and the workers
Ray keeps warm (their imports done) serve the next module's tasks.

Workers import the tests' helper modules (tests/e2e, tests/actors, tests/learner: the
runtime_env's PYTHONPATH) and leave marks under $TETHER_TEST_MARKS, a folder of the session's
own. A module that needs a Ray of its own (several nodes, another system config) calls
``leave()`` before its ``ray.init``; the next module that asks for the shared one starts it
again. Nothing a test starts outlives it (tests/conftest.py checks after every test).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import ray

TESTS = Path(__file__).resolve().parent
WORKER_PATH = [TESTS / "e2e", TESTS / "actors", TESTS / "learner", TESTS]
MARKS_VAR = "TETHER_TEST_MARKS"
# Logical CPUs: a whole job's pools (generators, scorers, buffer, learner ranks) on 2 cores.
NUM_CPUS = 8

_shared: dict = {}   # "address": the shared Ray's GCS address while it is up, "marks": its marks folder


def marks_dir() -> Path:
    """The folder the shared Ray's workers leave their marks in (one per test session)."""
    if "marks" not in _shared:
        _shared["marks"] = Path(tempfile.mkdtemp(prefix="tether-test-marks-"))
    return _shared["marks"]


def shared() -> Path:
    """Connect this process to the session's shared Ray (starting it if needed); returns the
    marks folder its workers write to."""
    if ray.is_initialized() and _connected_address() != _shared.get("address"):
        ray.shutdown()  # a module's own Ray was left connected
    if not ray.is_initialized():
        marks = marks_dir()
        os.environ[MARKS_VAR] = str(marks)  # the tests read the marks their workers leave
        path = os.pathsep.join([*map(str, WORKER_PATH), *filter(None, [os.environ.get("PYTHONPATH")])])
        context = ray.init(address="local", num_cpus=NUM_CPUS, include_dashboard=False, logging_level="WARNING",
                           runtime_env={"env_vars": {"PYTHONPATH": path, MARKS_VAR: str(marks)}})
        _shared["address"] = context.address_info["gcs_address"]
    return _shared["marks"]


def leave() -> None:
    """Disconnect from whatever Ray this process is connected to, before a ray.init of a module's own."""
    if ray.is_initialized():
        ray.shutdown()
    _shared.pop("address", None)


def stop() -> None:
    """End of the session: the shared Ray and its marks folder go."""
    leave()
    marks = _shared.pop("marks", None)
    if marks is not None:
        shutil.rmtree(marks, ignore_errors=True)


def _connected_address() -> str | None:
    return ray.get_runtime_context().gcs_address if ray.is_initialized() else None

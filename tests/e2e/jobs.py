"""The real entrypoint as a process of its own: start a run, wait for one of its steps, read
its metrics and status (shared by the resume and node-loss tests; `rows` also by the tests that
read a run's metrics while it runs)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMMON = ["run.steps=5", "run.checkpoint_every=2", "run.eval_every=0", "run.plot_every=0"]


def start(run_dir: Path, *overrides) -> subprocess.Popen:
    args = [f"run.dir={run_dir.parent}", f"run.name={run_dir.name}", *COMMON, *overrides]
    log = open(run_dir.parent / f"{run_dir.name}.log", "ab")
    # A session of its own: the test can clean up whatever the driver leaves behind.
    return subprocess.Popen([sys.executable, "-m", "cluster.train", *args], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 600) -> int:
    try:
        return proc.wait(timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # Ray processes a killed driver left behind
        except ProcessLookupError:
            pass


def rows(run_dir: Path) -> list[dict]:
    """The rows of the run's metrics.jsonl, also while the run appends to it: its complete lines
    (a line without its newline is still being written), each of which must parse."""
    data = (run_dir / "metrics.jsonl").read_bytes()
    return [json.loads(line) for line in data[:data.rfind(b"\n") + 1].decode().splitlines()]


def wait_for_step(run_dir: Path, proc: subprocess.Popen, step: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before step {step}"
        if (run_dir / "metrics.jsonl").exists() and any(r["step"] >= step for r in rows(run_dir)):
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout}s")


def status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())

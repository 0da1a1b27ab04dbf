"""Stopping and resuming the real entrypoint: kill -9 of the driver, SIGTERM, run.resume.

Each run is `python -m cluster.train` in its own process (and its own local Ray); the
driver is killed by the pid of the process the test started.
"""
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from jobs import finish, rows, start, status, wait_for_step

pytestmark = pytest.mark.e2e


# What the console shows before the first step: tether's own start-up lines (the libraries'
# go to the run folder's library.log and Ray's worker logs unless run.library_logs=true).
TETHER_START_UP = re.compile(r"\d\d:\d\d:\d\d (run folder: |(sync|async) PPO, |library logs: |threads per actor: |"
                             r"precision: |actors: |learner: trains |start-up: |step 0: )")


def first_screen(console: str) -> list[str]:
    lines = console.splitlines()
    first_step = next(i for i, ln in enumerate(lines) if re.search(r"\bstep 1/\d+ ", ln))
    return lines[:first_step]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs") / "baseline"
    assert finish(start(run_dir)) == 0
    return rows(run_dir)


def by_step(metric_rows, key):
    return [r.get(key) for r in metric_rows if r["step"] > 0]


@pytest.mark.slow  # three full runs; the default suite resumes a stopped run (below) and rolls back in-job
def test_kill_9_of_the_driver_then_resume_continues_the_same_run(baseline, tmp_path):
    run_dir = tmp_path / "killed"
    proc = start(run_dir)
    wait_for_step(run_dir, proc, 3)  # the checkpoint of step 2 is behind it
    os.kill(proc.pid, signal.SIGKILL)
    finish(proc)
    assert status(run_dir)["state"] == "running"  # what a kill -9 leaves: not a result
    assert finish(start(run_dir, f"run.resume={run_dir}")) == 0
    st = status(run_dir)
    assert st["state"] == "succeeded" and st["resumed_from_step"] == 2 and st["note"] == "resumed from step 2"
    resumed = rows(run_dir)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4, 5]  # none missing, none twice
    assert by_step(resumed, "data/batches_issued") == by_step(baseline, "data/batches_issued")
    assert by_step(resumed, "kl/beta")[:2] == by_step(baseline, "kl/beta")[:2]
    # Sampling is seeded per (seed, version, prompt) and the learner's state (weights,
    # optimizer, scheduler, shuffle) comes back whole, so the resumed steps are the same
    # steps: the same rewards, KL and losses as the run that was never interrupted.
    for key in ("reward/mean", "kl/mean", "kl/beta", "ppo/policy_loss", "ppo/value_loss", "ppo/grad_norm"):
        assert by_step(resumed, key) == pytest.approx(by_step(baseline, key), rel=1e-6, abs=1e-9), key


def test_sigterm_stops_async_run_with_a_checkpoint_and_resume_finishes(tmp_path):
    """Async mode: prompts drawn but not trained when it stops come back after the resume."""
    run_dir = tmp_path / "stopped"
    proc = start(run_dir, "run.mode=async")
    wait_for_step(run_dir, proc, 1)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = finish(proc, timeout=60)
    took = time.monotonic() - t0
    print(f"\nSIGTERM -> exit {rc} in {took:.1f}s")
    assert rc == 143 and took < 30
    console = (tmp_path / "stopped.log").read_text(errors="replace")
    # The stop notice may land before step 1's line: the signal follows its metrics row, not its line.
    noise = [ln for ln in first_screen(console) if not TETHER_START_UP.match(ln) and "SIGTERM received" not in ln]
    assert noise == [], console[-6000:]
    st = status(run_dir)
    assert st["state"] == "stopped" and st["resumable"] is True
    stopped_at = st["step"]
    assert Path(st["checkpoint"]).name == f"step-{stopped_at:06d}"
    at_stop = drawn_and_trained(Path(st["checkpoint"]))
    # The producer works a batch ahead of the learner: the stop left drawn prompts untrained.
    assert at_stop["unfinished"] > 0, at_stop
    assert finish(start(run_dir, "run.mode=async", "run.resume=auto")) == 0
    assert status(run_dir)["resumed_from_step"] == stopped_at
    resumed = rows(run_dir)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4, 5]
    assert [r["policy/version"] for r in resumed[1:]] == [1, 2, 3, 4, 5]
    assert all(r["buffer/staleness_max"] <= 1 for r in resumed[1:])  # buffer.max_staleness, across the restart
    assert all(r["buffer/dropped_stale"] == 0 and r["rollouts/skipped_prompts"] == 0 for r in resumed[1:])
    # Every prompt drawn is trained or still unfinished, across the restart: the ones the stop
    # left untrained came back (had they been lost, the later checkpoint would miss them).
    later = drawn_and_trained(max((run_dir / "checkpoints" / "resume").glob("step-*")))
    assert later["step"] > stopped_at and later["drawn"] == later["trained"] + later["unfinished"], later
    assert at_stop["drawn"] == at_stop["trained"] + at_stop["unfinished"], at_stop


def drawn_and_trained(checkpoint: Path) -> dict:
    """Prompt counts of a resumable checkpoint: drawn from the data, trained on, and unfinished
    (drawn, not trained: in flight or buffered). Every step trains data.prompts_per_step (16)."""
    state = json.loads((checkpoint / "state.json").read_text())
    return {"step": state["step"], "drawn": 16 * state["batches_issued"], "trained": 16 * state["step"],
            "unfinished": len(state["unfinished"])}

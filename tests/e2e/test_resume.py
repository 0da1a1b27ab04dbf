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

import numpy as np
import pytest
from jobs import finish, rows, start, status, wait_for_step

from cluster.data.prompts import PromptDataset
from cluster.demo.sentiment import builtin_prompts

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
    data = named_prompts(tmp_path / "prompts.jsonl")
    run_dir = tmp_path / "stopped"
    proc = start(run_dir, "run.mode=async", *data)
    wait_for_step(run_dir, proc, 1)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = finish(proc)
    took = time.monotonic() - t0
    # The stop comes at the next step boundary: what is left of the step, a checkpoint and the
    # shut-down, each less than this run's own start-up or a step of it, whatever the machine.
    ran = rows(run_dir)
    bound = ran[0]["perf/startup_seconds"] + 2 * max(r["perf/step_seconds"] for r in ran[1:])
    print(f"\nSIGTERM -> exit {rc} in {took:.1f}s (start-up + 2 slowest steps: {bound:.1f}s)")
    assert rc == 143 and took < bound, (took, bound)
    console = (tmp_path / "stopped.log").read_text(errors="replace")
    # The stop notice may land before step 1's line: the signal follows its metrics row, not its line.
    noise = [ln for ln in first_screen(console) if not TETHER_START_UP.match(ln) and "SIGTERM received" not in ln]
    assert noise == [], console[-6000:]
    st = status(run_dir)
    assert st["state"] == "stopped" and st["resumable"] is True
    stopped_at = st["step"]
    assert Path(st["checkpoint"]).name == f"step-{stopped_at:06d}"
    at_stop = json.loads((Path(st["checkpoint"]) / "state.json").read_text())
    # The producer works a batch ahead of the learner: the stop left drawn prompts untrained.
    assert at_stop["unfinished"], at_stop
    assert finish(start(run_dir, "run.mode=async", "run.resume=auto", *data)) == 0
    assert status(run_dir)["resumed_from_step"] == stopped_at
    resumed = rows(run_dir)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4, 5]
    assert [r["policy/version"] for r in resumed[1:]] == [1, 2, 3, 4, 5]
    assert all(r["buffer/staleness_max"] <= 1 for r in resumed[1:])  # buffer.max_staleness, across the restart
    assert all(r["buffer/dropped_stale"] == 0 and r["rollouts/skipped_prompts"] == 0 for r in resumed[1:])
    # Which prompts each step trained (the metrics rows, by data row), against the order the data
    # gives a run that is never stopped: none trained twice, across the restart ...
    trained = trained_by_step(resumed)
    everything = [i for step in sorted(trained) for i in trained[step]]
    assert len(everything) == len(set(everything)) == 5 * PER_STEP
    assert set(everything) <= set(draw_order()[:PER_STEP * resumed[-1]["data/batches_issued"]])
    # ... and none lost: at each checkpoint, the prompts trained so far and the ones it lists
    # unfinished (drawn, not trained: in flight or buffered) are the prompts drawn so far.
    later = json.loads((max((run_dir / "checkpoints" / "resume").glob("step-*")) / "state.json").read_text())
    assert later["step"] > stopped_at
    for state in (at_stop, later):
        assert_drawn_prompts_trained_or_unfinished(state, trained)
    # The ones the stop left untrained came back: trained after the resume, or still unfinished.
    after = {i for step in range(stopped_at + 1, later["step"] + 1) for i in trained[step]}
    assert set(at_stop["unfinished"]) <= after | set(later["unfinished"]), (at_stop, later)


# The data of the SIGTERM test: the built-in prompts, each row its own source, so that every
# metrics row says which prompts its step trained (reward/row<i>/count: data.source_field).
PER_STEP, EVAL, SEED = 16, 16, 0
ROW_COUNT = re.compile(r"reward/row(\d+)/count")


def named_prompts(path: Path) -> list[str]:
    """Writes the data file; returns the overrides that train on it."""
    path.write_text("".join(json.dumps({"prompt": p, "source": f"row{i}"}) + "\n"
                            for i, p in enumerate(builtin_prompts())))
    return [f"data.path={path}", f"data.prompts_per_step={PER_STEP}", f"data.eval_prompts={EVAL}",
            f"data.seed={SEED}"]


def draw_order() -> list[int]:
    """The data rows in the order a run draws them (its first epoch): the data's seeded
    stream over the prompts left after the held-out ones."""
    n = len(builtin_prompts())
    data = PromptDataset(texts=[""] * n, prompt_ids=[np.zeros(1, np.int64)] * n, ids=np.arange(n), seed=SEED)
    train, _ = data.split_eval(EVAL)
    return [int(i) for indices, _, _ in train.batches(PER_STEP, epochs=1) for i in indices]


def trained_by_step(metric_rows: list[dict]) -> dict[int, list[int]]:
    """step -> the data rows its batch trained, each with all its samples (sampling.n each)."""
    out = {}
    for r in metric_rows[1:]:
        counts = {int(m.group(1)): n for key, n in r.items() if (m := ROW_COUNT.fullmatch(key))}
        assert len(counts) == PER_STEP and set(counts.values()) == {r["rollouts/used"] // PER_STEP}, r["step"]
        out[r["step"]] = sorted(counts)
    return out


def assert_drawn_prompts_trained_or_unfinished(state: dict, trained: dict[int, list[int]]) -> None:
    """A resumable checkpoint's state.json: the prompts trained by its step and the ones it lists
    unfinished are, each once, the first data.prompts_per_step x batches drawn of the order."""
    done = [i for step in range(1, state["step"] + 1) for i in trained[step]]
    drawn = draw_order()[:PER_STEP * state["batches_issued"]]
    assert sorted(done + state["unfinished"]) == sorted(drawn), state

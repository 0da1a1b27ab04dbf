"""Stopping and resuming the real entrypoint: kill -9 of the driver, SIGTERM, run.resume.

Each run is `python -m cluster.train` in its own process (and its own local Ray); the
driver is killed by the pid of the process the test started. The SIGTERM run and its resume
write to all three experiment trackers (TensorBoard, W&B offline, MLflow), read back here.
"""
import json
import math
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tracker_stores as stores
from jobs import finish, rows, start, status, wait_for_step

from cluster.data.prompts import PromptDataset
from cluster.demo.sentiment import builtin_prompts

pytestmark = pytest.mark.e2e


# What the console shows before the first step: tether's own start-up lines (the libraries'
# go to the run folder's library.log and Ray's worker logs unless run.library_logs=true).
TETHER_START_UP = re.compile(r"\d\d:\d\d:\d\d (run folder: |(sync|async) PPO, |library logs: |wandb: run |"
                             r"threads per actor: |precision: |actors: |learner: trains |start-up: |step 0: )")
# MLflow's own lines (its local store's set-up), left to test_mlflow_prints_nothing_on_the_console.
MLFLOW_LINE = re.compile(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d [A-Z]+ mlflow[\w.]*: ")


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


@dataclass
class StoppedRun:
    """The SIGTERM run and its resume: what the stop left, read before the resume writes over it."""
    run_dir: Path
    rc: int                 # the stopped process's exit status
    took: float             # seconds from the signal to the exit
    bound: float            # the run's start-up + its 2 slowest steps
    console: str            # the stopped run's console
    status: dict            # status.json at the stop
    at_stop: dict           # state.json of the stop's checkpoint
    trackers_at_stop: dict  # trackers.json at the stop
    resume_rc: int


# All three experiment trackers on the SIGTERM run, samples every 2 steps, plots at the end of each start.
TRACKED = ["run.trackers=[tensorboard,wandb,mlflow]", "run.tracking.tags=[e2e]", "run.samples_every=2"]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> StoppedRun:
    """An async run on named prompts (below) with the trackers, SIGTERM'd once it has a step, then
    resumed by run.resume=auto to run.steps=5. One run serves every test of the stop and the resume."""
    tmp = tmp_path_factory.mktemp("sigterm")
    data = named_prompts(tmp / "prompts.jsonl")
    run_dir = tmp / "stopped"
    with pytest.MonkeyPatch.context() as env:  # the jobs' processes inherit it: W&B offline, its files in tmp
        for key, value in (("WANDB_MODE", "offline"), ("WANDB_PROJECT", "tether-e2e"),
                           ("WANDB_DATA_DIR", tmp / "wandb-data"), ("WANDB_CACHE_DIR", tmp / "wandb-cache"),
                           ("WANDB_CONFIG_DIR", tmp / "wandb-config")):
            env.setenv(key, str(value))
        env.delenv("MLFLOW_TRACKING_URI", raising=False)  # MLflow's store: the run folder's own
        proc = start(run_dir, "run.mode=async", "run.plot_every=3", *TRACKED, *data)
        try:
            wait_for_step(run_dir, proc, 1)
        except BaseException:  # no job left running behind a failed wait
            proc.kill()
            finish(proc)
            raise
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = finish(proc)
        took = time.monotonic() - t0
        ran = rows(run_dir)
        bound = ran[0]["perf/startup_seconds"] + 2 * max(r["perf/step_seconds"] for r in ran[1:])
        print(f"\nSIGTERM -> exit {rc} in {took:.1f}s (start-up + 2 slowest steps: {bound:.1f}s)")
        st = status(run_dir)
        checkpoint = Path(st.get("checkpoint") or run_dir / "none")
        at_stop = json.loads((checkpoint / "state.json").read_text()) if (checkpoint / "state.json").is_file() else {}
        console = (tmp / "stopped.log").read_text(errors="replace")
        trackers_at_stop = json.loads((run_dir / "trackers.json").read_text())
        # The resume's run.plot_every differs from the first start's: the trackers keep the config of
        # the start that created their runs.
        resume_rc = finish(start(run_dir, "run.mode=async", "run.resume=auto", "run.plot_every=2", *TRACKED, *data))
    return StoppedRun(run_dir, rc, took, bound, console, st, at_stop, trackers_at_stop, resume_rc)


def test_sigterm_stops_async_run_at_the_next_step_boundary(stopped):
    # The stop comes at the next step boundary: what is left of the step, a checkpoint, the trackers'
    # end and the shut-down, each less than this run's own start-up or a step of it, whatever the machine.
    assert stopped.rc == 143 and stopped.took < stopped.bound, (stopped.took, stopped.bound)
    # The stop notice may land before step 1's line: the signal follows its metrics row, not its line.
    noise = [ln for ln in first_screen(stopped.console)
             if not (TETHER_START_UP.match(ln) or MLFLOW_LINE.match(ln)) and "SIGTERM received" not in ln]
    assert noise == [], stopped.console[-6000:]


@pytest.mark.xfail(strict=True, reason="mlflow gives its logger a console handler of its own when it is imported, "
                   "which a run does when it starts the tracker, after quiet_console filtered the console's "
                   "handlers (cluster/runtime/observe/console.py): its lines reach the console")
def test_mlflow_prints_nothing_on_the_console(stopped):
    assert [ln for ln in stopped.console.splitlines() if MLFLOW_LINE.match(ln)] == []


def test_sigterm_leaves_a_resumable_checkpoint_of_its_step_with_drawn_prompts_untrained(stopped):
    st = stopped.status
    assert st["state"] == "stopped" and st["resumable"] is True
    assert Path(st["checkpoint"]).name == f"step-{st['step']:06d}"
    # The producer works a batch ahead of the learner: the stop left drawn prompts untrained.
    assert stopped.at_stop["step"] == st["step"] and stopped.at_stop["unfinished"], stopped.at_stop


def test_resume_after_sigterm_finishes_every_step_once_within_the_staleness_bound(stopped):
    """Async mode across the restart: one row per step, one policy version per step, no sample staler
    than buffer.max_staleness, none dropped, no prompt skipped."""
    assert stopped.resume_rc == 0
    assert status(stopped.run_dir)["resumed_from_step"] == stopped.status["step"]
    resumed = rows(stopped.run_dir)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4, 5]
    assert [r["policy/version"] for r in resumed[1:]] == [1, 2, 3, 4, 5]
    assert all(r["buffer/staleness_max"] <= 1 for r in resumed[1:])
    assert all(r["buffer/dropped_stale"] == 0 and r["rollouts/skipped_prompts"] == 0 for r in resumed[1:])


def test_prompts_drawn_but_untrained_at_sigterm_come_back_after_the_resume(stopped):
    """Which prompts each step trained (the metrics rows, by data row), against the order the data
    gives a run that is never stopped: none trained twice across the restart, none lost."""
    run_dir, stopped_at, at_stop = stopped.run_dir, stopped.status["step"], stopped.at_stop
    resumed = rows(run_dir)
    trained = trained_by_step(resumed)
    everything = [i for step in sorted(trained) for i in trained[step]]
    assert len(everything) == len(set(everything)) == 5 * PER_STEP
    assert set(everything) <= set(draw_order()[:PER_STEP * resumed[-1]["data/batches_issued"]])
    # At each checkpoint, the prompts trained so far and the ones it lists unfinished (drawn, not
    # trained: in flight or buffered) are the prompts drawn so far.
    later = json.loads((max((run_dir / "checkpoints" / "resume").glob("step-*")) / "state.json").read_text())
    assert later["step"] > stopped_at
    for state in (at_stop, later):
        assert_drawn_prompts_trained_or_unfinished(state, trained)
    # The ones the stop left untrained came back: trained after the resume, or still unfinished.
    after = {i for step in range(stopped_at + 1, later["step"] + 1) for i in trained[step]}
    assert set(at_stop["unfinished"]) <= after | set(later["unfinished"]), (at_stop, later)


# The trackers of the SIGTERM run, read back from what each wrote (W&B offline through wandb's own
# reader, MLflow's client on the run folder's store, TensorBoard's event reader). The stop's
# checkpoint is of the last step the trackers got, so the resume redoes no step: each tracker has
# every metrics.jsonl row at its step, once, the steps up to the stop from the first start.


def tracked_rows(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl by step, its finite numbers (what the trackers get)."""
    return {r["step"]: {k: v for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                        and math.isfinite(v) and k not in ("step", "time")} for r in rows(run_dir)}


def test_the_trackers_had_the_stop_step_last_so_the_resume_redoes_none(stopped):
    assert {name: t["last_step"] for name, t in stopped.trackers_at_stop.items()} == \
        {name: stopped.status["step"] for name in ("tensorboard", "wandb", "mlflow")}


def test_mlflow_has_every_row_once_config_samples_plots_and_the_checkpoint(stopped):
    run_dir = stopped.run_dir
    client, run = stores.mlflow_run(run_dir)
    rid, written = run.info.run_id, tracked_rows(run_dir)
    assert run.info.status == "FINISHED" and run.data.tags["tether.status"] == "finished"
    assert run.data.tags["tether.checkpoint"] == str((run_dir / "checkpoints" / "final").resolve())
    assert run.data.params["run.plot_every"] == "3"  # the first start's: the resume ran with 2
    assert run.data.params["run.steps"] == "5" and run.data.params["ppo.kl.beta"] == "0.05"
    assert run.data.tags["e2e"] == "true" and run.data.tags["tether.stage"] == "ppo"
    assert stores.mlflow_steps(client, rid, "kl/beta") == [1, 2, 3, 4, 5]
    assert stores.mlflow_steps(client, rid, "perf/startup_seconds") == [0]  # the resume starts after step 0
    for key in {k for row in written.values() for k in row}:
        history = client.get_metric_history(rid, key)
        for step, row in written.items():
            if key in row:
                got = [m.value for m in history if m.step == step]
                assert got == [pytest.approx(row[key], rel=1e-6, abs=1e-9)], (step, key)
    assert [a.path for a in client.list_artifacts(rid, "samples")] == ["samples/step-000002.json",
                                                                        "samples/step-000004.json"]
    assert {a.path for a in client.list_artifacts(rid, "plots")} >= {"plots/reward.png", "plots/kl.png"}


def test_wandb_continues_one_run_with_no_step_twice(stopped):
    run_dir, stopped_at = stopped.run_dir, stopped.status["step"]
    first, second = stores.wandb_records(run_dir)
    ids = {r["run"]["run_id"] for recs in (first, second) for r in recs if r["type"] == "run"}
    assert ids == {json.loads((run_dir / "trackers.json").read_text())["wandb"]["id"]}
    run = next(r["run"] for r in first if r["type"] == "run")
    assert run["project"] == "tether-e2e" and run["job_type"] == "ppo" and run["tags"] == ["e2e"]
    config = {k: v for r in first if r["type"] == "config" for k, v in r["config"].get("update", {}).items()}
    assert config["run.plot_every"] == 3 and config["run.steps"] == 5  # the first start's
    assert config["run.trackers"] == "['tensorboard', 'wandb', 'mlflow']"
    steps = [[h["_step"] for h in stores.wandb_history(recs)] for recs in (first, second)]
    assert steps == [list(range(stopped_at + 1)), list(range(stopped_at + 1, 6))]
    written, history = tracked_rows(run_dir), {h["_step"]: h for recs in (first, second)
                                               for h in stores.wandb_history(recs)}
    for step, row in written.items():
        for key, value in row.items():
            assert history[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (step, key)
    assert history[2]["samples._type"] == "table-file" and history[4]["samples._type"] == "table-file"
    # the plots at the end of each start: the stop's step, then the last
    assert history[stopped_at]["plots/reward._type"] == history[5]["plots/reward._type"] == "image-file"
    assert stores.wandb_summary(first)["status"] == "stopped"
    summary = stores.wandb_summary(second)
    assert summary["status"] == "finished" and summary["checkpoint"] == str(run_dir / "checkpoints" / "final")
    # a stopped run is resumable: not a failure
    assert [r["exit"]["exit_code"] for recs in (first, second) for r in recs if r["type"] == "exit"] == [0, 0]


def test_tensorboard_has_every_step_once(stopped):
    acc = stores.tensorboard(stopped.run_dir)
    assert [s for s, _ in stores.tb_scalar(acc, "kl/beta")] == [1, 2, 3, 4, 5]
    for tag in acc.Tags()["scalars"]:
        steps = [s for s, _ in stores.tb_scalar(acc, tag)]
        assert len(steps) == len(set(steps)), tag
    assert [s for s, _ in stores.tb_text(acc, "samples")] == [2, 4]
    assert {"plots/reward", "plots/kl"} <= set(acc.Tags()["images"])
    assert [t for _, t in stores.tb_text(acc, "status")] == ["stopped", "finished"]


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

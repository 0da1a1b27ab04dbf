"""Resizing the pools of a running job through the real CLI (python -m cluster.scale)."""
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
from jobs import rows

from cluster.config.ppo import DEFAULT_CONFIG
from cluster.job.folder import write_status
from cluster.runtime.prepare import prepare
from cluster.runtime.service import start_control

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


def scale_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "cluster.scale", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, message", [
    (["generator=0"], "at least 1 replica"),
    (["learner=2"], "pool one of generator, reference, reward"),
    (["generator=two"], "must be an integer"),
    ([], "nothing to change"),
])
def test_scale_mistakes_exit_2_with_one_line(tmp_path, args, message):
    (tmp_path / "status.json").write_text(json.dumps({"state": "running"}))
    r = scale_cli(tmp_path, *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_scale_refuses_a_folder_that_is_not_a_running_job(tmp_path):
    assert "not a run folder" in scale_cli(tmp_path, "generator=2").stderr
    (tmp_path / "status.json").write_text(json.dumps({"state": "succeeded"}))
    r = scale_cli(tmp_path, "generator=2")
    assert r.returncode == 2 and "is succeeded, not running" in r.stderr


@pytest.fixture
def running_job(tmp_path):
    """The default job, driven in a thread of this process, with its control actor and status.json."""
    import rays

    from cluster.config.ppo import load_config
    from cluster.runtime.loop.driver import Driver
    from cluster.runtime.observe.metrics import RunMetrics
    from cluster.runtime.pools.launch import create_pools
    rays.shared()
    cfg = load_config(DEFAULT_CONFIG, ["model.dtype=float32", "run.eval_every=0", "run.samples_every=0",
                                             "run.steps=10000",
                                             "run.checkpoint_every=0"])
    policy, tokenizer_path, tokenizer, train_set, _ = prepare(cfg)
    pools = create_pools(cfg, policy_path=policy, tokenizer_path=tokenizer_path)
    control, info = start_control(tmp_path, pools)
    write_status(tmp_path, "running", control=info)
    metrics = RunMetrics(run_dir=tmp_path, plot_every=0)
    driver = Driver(cfg, pools=pools, dataset=train_set, eval_dataset=None, tokenizer=tokenizer,
                    metrics=metrics, control=control)
    thread = threading.Thread(target=driver.run, daemon=True)
    thread.start()
    try:
        yield driver
    finally:
        driver.stop_requested.set()
        thread.join(120)
        metrics.close()
        pools.shutdown()


def rows_after(run_dir: Path, step: int) -> list[dict]:
    """The rows written so far of the steps after ``step`` (the driver is still stepping)."""
    return [r for r in rows(run_dir) if r["step"] > step]


STEP_STALL_S = 600  # a hang guard per step: a step, even one that starts new replicas, takes far less


def wait_steps(driver, n: int) -> int:
    """Until the job has made ``n`` more steps; it fails only if one step does not come within
    STEP_STALL_S of the one before (the job stopped stepping), however long the steps take here."""
    target, last = driver.step_count + n, driver.step_count
    deadline = time.monotonic() + STEP_STALL_S
    while driver.step_count < target:
        if driver.step_count != last:
            last, deadline = driver.step_count, time.monotonic() + STEP_STALL_S
        assert time.monotonic() < deadline, f"the job stopped stepping: no step after step {last} in {STEP_STALL_S}s"
        time.sleep(0.05)
    return driver.step_count


def test_pools_scale_up_and_down_while_the_job_runs(running_job, tmp_path):
    driver = running_job
    wait_steps(driver, 2)
    r = scale_cli(tmp_path, "generator=2", "reward=2")
    assert r.returncode == 0, r.stderr
    assert "pools now generator=2" in r.stdout
    applied_at = driver.step_count
    ray.get_actor("generator-1"), ray.get_actor("reward-1")  # named actors, as the dashboard lists them
    wait_steps(driver, 3)
    after = rows_after(tmp_path, applied_at)
    assert all(m["pool/generator_replicas"] == 2 and m["pool/reward_replicas"] == 2 for m in after)
    # The new generator served with the learner's weights from its first prompt (sync mode).
    assert all(m["ppo/logprob_gap_mean"] < 1e-3 for m in after)
    new = ray.get(driver.pools.generators.handles()["generator-1"].health.remote())
    assert new["generated_tokens"] > 0 and new["version"] == driver.version
    # A checkpoint records the scaled sizes: a resume starts the pools there (tests/cluster/job/test_lifecycle.py).
    assert driver.run_state().pool_sizes == {"generator": 2, "reference": 1, "reward": 2}

    r = scale_cli(tmp_path, "generator=1")
    assert r.returncode == 0, r.stderr
    shrunk_at = driver.step_count
    reached = wait_steps(driver, 2)
    assert all(m["pool/generator_replicas"] == 1 for m in rows_after(tmp_path, shrunk_at))
    assert list(driver.pools.generators.handles()) == ["generator-0"]  # the newest went first
    with pytest.raises(ValueError):
        ray.get_actor("generator-1")
    # Every step's row, in order, up to at least the one before the step reached (its own row is
    # written after the step counts as done).
    versions = [m["policy/version"] for m in rows_after(tmp_path, 0)]
    assert versions == list(range(1, len(versions) + 1)) and len(versions) >= reached - 1, (versions, reached)

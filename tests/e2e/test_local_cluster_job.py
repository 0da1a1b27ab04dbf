"""The try-out of docs/guide/clusters.md ("Trying it on one machine"), whole: `tether cluster up`,
the default job through `ray job submit` to it (the command `status` prints), the job SUCCEEDED
with its steps in metrics.jsonl, and `tether cluster down` leaving none of the cluster's processes
behind."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.nodes import local

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
STEPS = 2


# With --netns: each worker node in a network namespace with its own address, and the learner's
# two ranks spread over two of them (their rendezvous and gloo on the nodes' addresses).
NETNS = {False: ([], []), True: (["--netns", "--workers", "3"], ["learner.replicas=2", "learner.strategy=spread"])}


@pytest.mark.parametrize("netns", [False, True], ids=["one-address", "netns"])
def test_default_job_on_a_local_multi_node_cluster(tmp_path, netns):
    up_args, job_args = NETNS[netns]
    if netns:
        from cluster.nodes.netns import NetnsError, check_available
        try:
            check_available()
        except NetnsError as e:
            pytest.skip(f"no network namespaces here: {e}")
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(32))
    env = {**os.environ, "RAY_AUTH_TOKEN_PATH": str(token), "RAY_AUTH_MODE": "token",
           "PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")])}
    home, run_dir = tmp_path / "cluster", tmp_path / "runs" / "job"
    home.mkdir()

    def tether(*args):
        return subprocess.run([str(BIN / "tether"), "cluster", *args], cwd=home, env=env, capture_output=True,
                              text=True, timeout=300)

    temp_dir = None
    try:
        assert (up := tether("up", "--workers", "2", *up_args)).returncode == 0, up.stderr
        temp_dir = local.load(home / local.STATE_FILE).temp_dir
        info = json.loads(tether("status", "--json").stdout)
        job = subprocess.run(
            [str(BIN / "ray"), "job", "submit", "--address", info["dashboard_url"], "--working-dir", ".",
             "--runtime-env-json", json.dumps({"excludes": local.EXCLUDES + ["*.egg-info", ".pytest_cache"]}),
             "--", "python", "-m", "cluster.train", f"run.steps={STEPS}", f"run.dir={run_dir.parent}",
             f"run.name={run_dir.name}", "run.eval_every=0", *job_args],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert job.returncode == 0 and "succeeded" in job.stdout + job.stderr, job.stdout[-3000:] + job.stderr[-2000:]
        steps = [json.loads(line).get("step") for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [s for s in steps if s] == list(range(1, STEPS + 1))
        assert json.loads((run_dir / "status.json").read_text())["state"] == "succeeded"
        state = local.load(home / local.STATE_FILE)
        assert (down := tether("down")).returncode == 0, down.stderr
        assert not local.running(state)  # no process, and with --netns no namespace or link
    finally:
        state = local.load(home / local.STATE_FILE)
        if state is not None:
            local.stop(state)
        if temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)

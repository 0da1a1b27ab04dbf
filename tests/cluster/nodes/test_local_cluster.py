"""`tether cluster`: a head and labelled worker nodes on this machine, started with the real
`ray start`, listed, one of them lost, and stopped again, leaving an unrelated Ray running
beside it untouched. Mistakes end in one line and exit code 2, before anything starts.

The token is the test's own (RAY_AUTH_TOKEN_PATH), so ~/.ray/auth_token is neither needed nor
written. Whatever a test started is stopped in its fixture's teardown, through the record.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from cluster.nodes import local
from cluster.nodes.ports import wait_listening

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]
TETHER = Path(sys.executable).with_name("tether")
# A Ray of someone else's on this machine: started like a user's script, answers "ping".
OTHER_RAY = """
import sys, ray
ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR")
print(ray.get_runtime_context().get_node_id(), flush=True)
for line in sys.stdin:
    print(ray.get(ray.remote(lambda: "pong").remote()), flush=True)
ray.shutdown()
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    token = tmp_path_factory.mktemp("auth") / "token"
    token.write_text(secrets.token_hex(32))
    return {**os.environ, "RAY_AUTH_TOKEN_PATH": str(token), "RAY_AUTH_MODE": "token"}


def tether(cwd: Path, env: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(TETHER), "cluster", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def one_line_error(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tether: error: "), result.stderr
    assert all(w in lines[0] for w in words), lines[0]


@pytest.fixture(scope="module")
def other_ray(env):
    proc = subprocess.Popen([sys.executable, "-c", OTHER_RAY], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        node_id = proc.stdout.readline().strip()
        assert node_id, "the unrelated Ray did not start"
        yield proc, node_id
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, env, other_ray):
    """`tether cluster up --workers 2` in a folder of its own; down (or the library) after."""
    cwd, temp_dir = tmp_path_factory.mktemp("cluster"), None
    try:
        result = tether(cwd, env, "up", "--workers", "2", "--labels-per-worker", "zone=a", "zone=b,disk=ssd")
        assert result.returncode == 0, result.stderr
        temp_dir = local.load(cwd / local.STATE_FILE).temp_dir
        yield cwd
    finally:
        state = local.load(cwd / local.STATE_FILE)
        if state is not None:  # the test failed before its own `down`
            local.stop(state)
        if temp_dir:  # Ray's sessions and logs of this cluster
            shutil.rmtree(temp_dir, ignore_errors=True)


def test_up_status_kill_node_down_leaves_other_ray_alone(cluster, env, other_ray):
    status = tether(cluster, env, "status", "--json")
    assert status.returncode == 0, status.stderr
    info = json.loads(status.stdout)
    workers = {n["name"]: n for n in info["nodes"] if n["name"] != "head"}
    assert [n["name"] for n in info["nodes"]] == ["head", "worker-1", "worker-2"]
    assert info["nodes"][0]["cpus"] == 0 and all(n["alive"] for n in info["nodes"])
    assert workers["worker-1"]["labels"] == {"tether.node": "worker-1", "zone": "a"}
    assert workers["worker-2"]["labels"] == {"tether.node": "worker-2", "zone": "b", "disk": "ssd"}
    assert {n["cpus"] for n in workers.values()} == {2}
    assert f"ray job submit --address {info['dashboard_url']}" in info["submit"]
    assert len({n["id"] for n in info["nodes"]} | {other_ray[1]}) == 4  # each its own raylet
    # The Ray Client server's port is the OS's choice too (held until the server took it)
    assert info["client_port"] > 0 and wait_listening(info["client_port"], timeout_s=5)

    one_line_error(tether(cluster, env, "up"), "still up", "tether cluster down")
    one_line_error(tether(cluster, env, "kill-node", "worker-9"), "worker-9", "worker-1", "worker-2")
    one_line_error(tether(cluster, env, "kill-node", info["head_id"][:8]), "head node")

    killed = tether(cluster, env, "kill-node", workers["worker-2"]["id"][:10])
    assert killed.returncode == 0 and "worker-2" in killed.stdout, killed.stderr
    deadline = time.monotonic() + 30
    while next(n for n in json.loads(tether(cluster, env, "status", "--json").stdout)["nodes"]
               if n["name"] == "worker-2")["alive"]:
        assert time.monotonic() < deadline, "worker-2 still listed alive 30 s after kill-node"
        time.sleep(0.5)

    state = local.load(cluster / local.STATE_FILE)
    ours = [p.pid for stage in local.processes(state) for p in stage]
    other = [local.node_processes(other_ray[1])[0].pid, local.gcs_of(other_ray[1]).pid]
    down = tether(cluster, env, "down")
    assert down.returncode == 0, down.stderr
    assert not (cluster / local.STATE_FILE).exists()
    left = [pid for pid in ours if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert left == [] and not any(local.processes(state)), f"still running after down: {left}"
    assert all(psutil.Process(pid).is_running() for pid in other)
    proc, _ = other_ray
    proc.stdin.write("ping\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "pong"


def test_down_and_status_with_nothing_up(tmp_path, env):
    for command in ("status", "kill-node", "cut-link"):
        args = [command, "worker-1"] if command != "status" else [command]
        one_line_error(tether(tmp_path, env, *args), "no cluster is recorded here", "tether cluster up")
    down = tether(tmp_path, env, "down")  # a second down, or one after a failed up: nothing to do
    assert down.returncode == 0 and "nothing to stop" in down.stdout, down.stderr


@pytest.mark.parametrize("args, words", [
    (["up", "--workers", "0"], ["--workers"]),
    (["up", "--workers", "3", "--cpus-per-worker", "1", "2"], ["2 values", "3 workers"]),
    (["up", "--labels-per-worker", "zone"], ["'zone'", "key=value"]),
    (["up", "--labels-per-worker", "tether.node=x"], ["tether.node"]),
    (["up", "--workers", "two"], ["invalid int value"]),
    (["kill-node"], ["node"]),
    (["frobnicate"], ["invalid choice"]),
])
def test_mistakes_are_one_line_and_start_nothing(tmp_path, env, args, words):
    one_line_error(tether(tmp_path, env, *args), *words)
    assert list(tmp_path.iterdir()) == []


def test_a_taken_client_port_is_named_with_the_flag_that_changes_it(tmp_path, env):
    with socket.socket() as taken:  # held, listening, for the whole call
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        one_line_error(tether(tmp_path, env, "up", f"--client-port={port}"), str(port), "--client-port")
    assert list(tmp_path.iterdir()) == []


def test_netns_up_gives_each_worker_its_own_address_and_down_removes_all_even_after_a_crash(tmp_path, env):
    """`up --netns`: each worker node in a namespace of its own with an address on the bridge,
    the head and dashboard on the bridge's address; a node's link cut and restored; `down`
    removes every namespace and link, also after an `up` killed mid-way, and a second `down`
    has nothing to do. Skips where namespaces cannot be made."""
    from cluster.nodes import netns
    try:
        netns.check_available()
    except netns.NetnsError as e:
        pytest.skip(f"no network namespaces here: {e}")
    crashed, home = tmp_path / "crashed", tmp_path / "home"
    crashed.mkdir()
    home.mkdir()
    up = subprocess.Popen([str(TETHER), "cluster", "up", "--netns", "--workers", "2"], cwd=crashed, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120  # killed once it has made its namespaces (or finished)
    while not (crashed / local.STATE_FILE).is_file() or not (local.load(crashed / local.STATE_FILE).net or {}):
        assert up.poll() is None or (crashed / local.STATE_FILE).is_file(), "up ended without a record"
        assert time.monotonic() < deadline, "up recorded no namespaces in 120 s"
        time.sleep(0.05)
    os.killpg(up.pid, 9)
    up.wait()
    try:
        result = tether(home, env, "up", "--netns", "--workers", "1")
        assert result.returncode == 0, result.stderr
        info = json.loads(tether(home, env, "status", "--json").stdout)
        net = netns.from_dict(info["net"])
        head, worker = info["nodes"]
        assert head["ip"] == net.host_ip != worker["ip"] == net.nodes["worker-1"]["ip"]
        assert info["dashboard_url"] == f"http://{net.host_ip}:{info['dashboard_url'].rsplit(':', 1)[1]}"
        assert wait_listening(int(info["dashboard_url"].rsplit(":", 1)[1]), 5, host=net.host_ip)
        for command in ("cut-link", "restore-link"):
            done = tether(home, env, command, "worker-1")
            assert done.returncode == 0 and "worker-1" in done.stdout, done.stderr
    finally:
        for folder in (crashed, home):
            state = local.load(folder / local.STATE_FILE)
            down = tether(folder, env, "down")
            assert down.returncode == 0, down.stderr
            assert tether(folder, env, "down").returncode == 0  # again: nothing to do
            if state is not None:
                assert not local.running(state), f"left behind in {folder.name}"
                shutil.rmtree(state.temp_dir, ignore_errors=True)

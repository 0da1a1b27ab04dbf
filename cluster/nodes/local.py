"""A Ray cluster of several nodes on this machine, to try tether on (``tether cluster``).

A head and N worker nodes, each its own raylet with its own object store, CPUs and labels,
started with the real ``ray start`` of this Python environment:

- The head has no CPUs: a job's driver runs there and every actor on a worker node.
- Every port is the OS's choice (``--port=0``, ``--dashboard-port=0``, the agents' 0), read
  back afterwards. The head's Ray Client server needs a number (Ray 2.60 refuses 0): one the
  OS chose, held until the server has it (cluster/nodes/ports.py), or ``client_port`` when
  given, checked free first.
- Its own ``--temp-dir`` (/tmp/tether-ray-*), which the worker nodes share: its sessions,
  logs and address file are this cluster's only, so a plain ``ray.init()`` elsewhere never
  joins it by accident.
- Token authentication stays on (``RAY_AUTH_MODE=token``; the token is made if missing).
- With ``netns`` (``--netns``) each worker node's raylet runs in a network namespace of its own
  with its own address, on a bridge whose address is the head's (cluster/nodes/netns.py): the
  nodes then reach each other only over TCP between their own addresses, as machines do. The
  head, the driver, ``ray job submit`` and the dashboard stay in this machine's namespace, on
  the bridge's address.
- What it started is recorded in STATE_FILE. ``down`` stops exactly that: each node's raylet
  and its descendants and the GCS, found by node id (cluster/nodes/kill.py), and the head's
  other processes (dashboard, monitor, log monitors), which live in the sessions of our own
  ``ray start`` calls and name this cluster's temp dir. Never ``ray stop``: that stops every
  Ray on the machine.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import psutil

from cluster.nodes import netns
from cluster.nodes.health import system_config_flag
from cluster.nodes.kill import NodeNotFound, gcs_of, kill_node, node_processes
from cluster.nodes.ports import held_port, wait_listening
from cluster.nodes.stopping import processes as processes, running as running, stop  # re-exported
from core.infra.errors import UserError

STATE_FILE = ".tether-cluster.json"
NODE_LABEL = "tether.node"              # worker-1, worker-2, ... (the head: head)
START_TIMEOUT_S = 180.0                 # one `ray start` (a loaded laptop can take a minute)
JOIN_TIMEOUT_S = 60.0                   # until every node is listed alive
EXCLUDES = [".venv", "runs", ".git"]
_LABEL = re.compile(r"^[A-Za-z0-9]([\w./-]*[A-Za-z0-9])?=[\w./-]*$")


class LocalClusterError(UserError):
    """A mistake in the request or a cluster that cannot start: one line, exit code 2."""


@dataclass
class State:
    temp_dir: str
    gcs_address: str
    dashboard_url: str
    head_id: str
    workers: dict[str, dict] = field(default_factory=dict)   # node id -> its labels, in order
    sessions: list[int] = field(default_factory=list)         # session ids of our `ray start`s
    pids: dict[str, int] = field(default_factory=dict)        # "raylet <id>" / "gcs": pid at start
    started_at: float = 0.0
    workdir: str = "."
    client_port: int = 0                                      # the head's Ray Client server
    net: dict | None = None                                   # --netns: netns.Net, recorded before made


def parse_labels(text: str) -> dict:
    """``k=v[,k=v...]`` (empty: none) as a dict; tether.node is set by tether."""
    labels = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        if not _LABEL.match(item):
            raise LocalClusterError(f"label {item!r} is not key=value (letters, digits, . _ - /)")
        key, _, value = item.partition("=")
        if key == NODE_LABEL:
            raise LocalClusterError(f"{NODE_LABEL} is set by tether (worker-1, worker-2, ...); use another key")
        labels[key] = value
    return labels


def ray_env() -> dict:
    """This environment for `ray` and the processes it starts: token auth on, and this
    Python's bin first on PATH (a submitted `python -m cluster.train` must find the stack)."""
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "RAY_AUTH_MODE": "token", "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")])}


def _ray(*args: str) -> list[str]:
    return [str(Path(sys.executable).with_name("ray")), *args]


def _ensure_token(env: dict) -> None:
    if env.get("RAY_AUTH_TOKEN") or env.get("RAY_AUTH_TOKEN_PATH") or (Path.home() / ".ray" / "auth_token").is_file():
        return
    subprocess.run(_ray("get-auth-token", "--generate"), env=env, capture_output=True, check=True)


def _port_taken(port: int) -> bool:
    try:
        return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in psutil.net_connections("tcp"))
    except psutil.AccessDenied:  # macOS without root: let Ray find out
        return False


def _start(args: list[str], log: Path, env: dict, prefix: list[str] = ()) -> subprocess.Popen:
    """`ray start ...` in a session of its own: everything it spawns inherits the session.
    ``prefix``: what runs it (``ip netns exec <ns>``, which execs it: the same process)."""
    with open(log, "wb") as out:
        return subprocess.Popen([*prefix, *_ray("start", *args)], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)


def _finish(name: str, proc: subprocess.Popen, log: Path) -> None:
    """Wait for a `ray start` to return; a failure as one line, naming its log."""
    try:
        rc = proc.wait(timeout=START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise LocalClusterError(f"`ray start` of the {name} did not return in {START_TIMEOUT_S:.0f}s; "
                                f"see {log}") from None
    if rc != 0:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        raise LocalClusterError(f"`ray start` of the {name} failed: {lines[-1] if lines else f'exit {rc}'} "
                                f"(whole output: {log})")


def _head_args(temp: Path, client_port: int, host_ip: str | None, system_config: dict | None) -> list[str]:
    own_address = [f"--node-ip-address={host_ip}", f"--dashboard-host={host_ip}"] if host_ip else []
    return ["--head", "--num-cpus=0", "--num-gpus=0", "--port=0", "--dashboard-port=0",
            "--dashboard-agent-listen-port=0", f"--ray-client-server-port={client_port}",
            "--include-dashboard=true", f"--temp-dir={temp}", "--disable-usage-stats",
            system_config_flag(system_config), "--labels", f"{NODE_LABEL}=head", *own_address]


def _worker_args(gcs: str, cpus: int, labels: dict, ip: str | None) -> list[str]:
    text = ",".join(f"{k}={v}" for k, v in labels.items())
    return [f"--address={gcs}", f"--num-cpus={cpus}", "--num-gpus=0", "--dashboard-agent-listen-port=0",
            "--disable-usage-stats", "--labels", text, *([f"--node-ip-address={ip}"] if ip else [])]


def host_ip(state: State) -> str:
    """The head's address: the bridge's with --netns, else this machine's loopback."""
    return state.net["host_ip"] if state.net else "127.0.0.1"


def up(cpus: list[int], labels: list[dict], *, client_port: int | None = None, workdir: Path,
       use_netns: bool = False, system_config: dict | None = None,
       record: Callable[[State], None] = lambda state: None) -> State:
    """Start the head and one worker node per entry of ``cpus``; wait until all are alive.
    ``client_port``: the head's Ray Client server's; None, one the OS chooses. ``use_netns``:
    each worker in a network namespace of its own (cluster/nodes/netns.py). ``system_config``:
    Ray's, on top of the fast node-failure detection. ``record(state)`` is called whenever
    the state grows, first before anything is made, so a crash leaves what `down` needs."""
    if client_port is not None and _port_taken(client_port):
        raise LocalClusterError(f"port {client_port} (the head's Ray Client server) is in use, likely by "
                                "another Ray head; choose a free one with --client-port=PORT")
    net = None
    if use_netns:
        netns.check_available()
        net = netns.plan(len(cpus), netns.free_subnet(netns.used_networks()))
    env = ray_env()
    _ensure_token(env)
    temp = Path(tempfile.mkdtemp(prefix="tether-ray-", dir="/tmp" if os.path.isdir("/tmp") else None))
    state = State(temp_dir=str(temp), gcs_address="", dashboard_url="", head_id="", started_at=time.time(),
                  workdir=str(workdir.resolve()), net=netns.as_dict(net))
    try:
        record(state)
        if net is not None:
            netns.create(net)
        _start_head(state, client_port, env, system_config, record)
        for i, (n, extra) in enumerate(zip(cpus, labels), start=1):  # one at a time: concurrent
            start_worker(state, f"worker-{i}", n, extra, env, record)  # starts race for socket names
        _join(state, len(cpus))
        state.pids = _pids(state)
        record(state)
        return state
    except BaseException:
        stop(state)
        raise


def _start_head(state: State, client_port: int | None, env: dict, system_config: dict | None,
                record: Callable[[State], None]) -> None:
    temp, ip = Path(state.temp_dir), state.net["host_ip"] if state.net else None
    with held_port() if client_port is None else contextlib.nullcontext(client_port) as port:
        head = _start(_head_args(temp, port, ip, system_config), temp / "ray-start-head.log", env)
        state.sessions.append(head.pid)
        state.client_port = port
        record(state)
        _finish("head", head, temp / "ray-start-head.log")
        if not wait_listening(port, JOIN_TIMEOUT_S, host_ip(state)):  # a held port stays ours until it listens
            raise LocalClusterError(f"the head's Ray Client server is not listening on port {port} after "
                                    f"{JOIN_TIMEOUT_S:.0f}s; see the logs in {temp}/session_latest/logs")
    state.gcs_address = (temp / "ray_current_cluster").read_text().strip()  # written by `ray start`
    record(state)


def start_worker(state: State, name: str, cpus: int, labels: dict, env: dict | None = None,
                 record: Callable[[State], None] = lambda state: None) -> None:
    """`ray start` one worker node labelled tether.node=``name``; with --netns in a namespace
    of its own, planned, recorded and made here if ``state`` has none for it yet. Returns once
    `ray start` has; the node joins the cluster a moment later."""
    prefix, ip, log = [], None, Path(state.temp_dir) / f"ray-start-{name}.log"
    net = netns.from_dict(state.net)
    if net is not None:
        if name not in net.nodes:
            netns.add_node(net, name)
            state.net = netns.as_dict(net)
            record(state)
            netns.create_node(net, name)
        prefix, ip = netns.exec_prefix(net, name), net.nodes[name]["ip"]
    env = env or ray_env()
    proc = _start(_worker_args(state.gcs_address, cpus, {NODE_LABEL: name, **labels}, ip), log,
                  netns.node_env(env) if net is not None else env, prefix)
    state.sessions.append(proc.pid)
    record(state)
    _finish(name, proc, log)


def token_auth_on() -> None:
    """Token auth for this process's connections to the cluster. Ray reads the mode when its
    core library loads (tether cluster's main sets it before), and again on this refresh, for
    a process that imported Ray earlier (a test session)."""
    os.environ["RAY_AUTH_MODE"] = "token"
    from ray._raylet import Config

    Config.initialize("")


def _connect(address: str):
    """Join as a driver, with token auth on."""
    import logging

    import ray

    token_auth_on()

    try:
        return ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    except ConnectionError as e:
        raise LocalClusterError(f"cannot join the new cluster at {address}: {e}") from None


def _join(state: State, n_workers: int) -> None:
    """Connect once: the dashboard's URL, and every node listed alive (with its id) in time."""
    import ray

    context = _connect(state.gcs_address)
    try:
        state.dashboard_url = f"http://{context.dashboard_url}"
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while True:
            alive = {n["Labels"].get(NODE_LABEL): n for n in ray.nodes() if n["Alive"]}
            workers = [alive.get(f"worker-{i}") for i in range(1, n_workers + 1)]
            if "head" in alive and all(workers):
                break
            if time.monotonic() > deadline:
                raise LocalClusterError(f"only {len(alive)} of {n_workers + 1} nodes joined in {JOIN_TIMEOUT_S:.0f}s; "
                                        f"see the logs in {state.temp_dir}/session_latest/logs")
            time.sleep(0.1)
        state.head_id = alive["head"]["NodeID"]
        state.workers = {w["NodeID"]: _own(w["Labels"]) for w in workers}
    finally:
        ray.shutdown()


def _pids(state: State) -> dict[str, int]:
    pids = {f"raylet {nid}": node_processes(nid)[0].pid for nid in [state.head_id, *state.workers]}
    pids["gcs"] = gcs_of(state.head_id).pid
    return pids


def _own(labels: dict) -> dict:
    """A node's labels without the ones Ray sets itself (ray.io/...)."""
    return {k: v for k, v in labels.items() if not k.startswith("ray.io/")}


def save(state: State, path: Path) -> None:
    """Written whole or not at all (a reader, or a crash, never sees half a record)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(asdict(state), indent=1) + "\n")
    partial.replace(path)


def load(path: Path) -> State | None:
    """The cluster recorded in ``path``, or None if there is none."""
    if not path.is_file():
        return None
    try:
        return State(**json.loads(path.read_text()))
    except (ValueError, TypeError) as e:
        raise LocalClusterError(f"{path} is not a tether cluster record ({e}); delete it if no cluster "
                                "of ours runs") from None


# ------------------------------------------------------------------------------ using it

def nodes(state: State) -> list[dict]:
    """Every node of the cluster as the GCS sees it (dead ones too), head first."""
    from ray.util.state import list_nodes

    os.environ["RAY_AUTH_MODE"] = "token"
    try:
        listed = list_nodes(address=state.dashboard_url, detail=True, raise_on_missing_output=False)
    except Exception as e:  # noqa: BLE001 - any failure to reach it is one line
        raise LocalClusterError(f"cannot reach the cluster's dashboard at {state.dashboard_url} "
                                f"({type(e).__name__}); `tether cluster down` stops what is left of it") from None
    rows = [{"id": n.node_id, "name": n.labels.get(NODE_LABEL, "?"), "labels": _own(n.labels),
             "cpus": n.resources_total.get("CPU", 0), "alive": n.state == "ALIVE", "ip": n.node_ip} for n in listed]
    return sorted(rows, key=lambda r: (r["name"] != "head", len(r["name"]), r["name"]))


def resolve(state: State, name: str) -> str:
    """A worker node's id from its id, a unique prefix of it, or its name (worker-2)."""
    names = {labels.get(NODE_LABEL): nid for nid, labels in state.workers.items()}
    hits = [names[name]] if name in names else [nid for nid in state.workers if nid.startswith(name)]
    if name == "head" or (name and not hits and state.head_id.startswith(name)):
        raise LocalClusterError("that is the head node (it holds the GCS and the job's driver); "
                                "kill a worker node: " + ", ".join(names))
    if len(hits) != 1:
        known = ", ".join(f"{n} ({nid[:12]})" for n, nid in names.items())
        what = "matches several nodes" if hits else "is no node of this cluster"
        raise LocalClusterError(f"{name!r} {what}; its worker nodes: {known}")
    return hits[0]


def kill(state: State, name: str) -> tuple[str, list[int]]:
    """SIGKILL one worker node whole (its raylet and every process it started)."""
    node_id = resolve(state, name)
    try:
        return node_id, kill_node(node_id)
    except NodeNotFound:
        raise LocalClusterError(f"node {state.workers[node_id].get(NODE_LABEL)} ({node_id[:12]}) is not "
                                "running any more (killed already?)") from None


def set_link(state: State, name: str, *, up: bool) -> str:
    """Take a worker node's link down (a network partition: its processes run on, unreachable)
    or up again; returns the node's name. Only a cluster started with --netns has links."""
    node_id = resolve(state, name)
    worker = state.workers[node_id][NODE_LABEL]
    net = netns.from_dict(state.net)
    if net is None:
        raise LocalClusterError("this cluster's nodes share one address (it was started without --netns); "
                                "start one with `tether cluster up --netns` to cut a node's link")
    (netns.restore if up else netns.cut)(net, worker)
    return worker


def submit_command(state: State, args: str = "run.steps=3") -> str:
    """The `ray job submit` of the default job to this cluster; the run folder in ./runs."""
    runtime_env = json.dumps({"excludes": EXCLUDES})
    return (f"RAY_AUTH_MODE=token ray job submit --address {state.dashboard_url} --working-dir . \\\n"
            f"  --runtime-env-json '{runtime_env}' \\\n"
            f"  -- python -m cluster.train {args} run.dir={Path(state.workdir) / 'runs'}")


"""Ray worker nodes with network stacks and addresses of their own, on this machine: the code of
``tether cluster up --netns`` (cluster/nodes/local.py, cluster/nodes/netns.py) as a test
fixture. The head runs in this machine's namespace on the bridge's address, with no CPUs; this
process joins as the driver. Each worker node is a raylet in a namespace of its own, reaching
the head and the other nodes only over the bridge, so a node can be partitioned by cutting its
link (``cut``) and brought back (``restore``).

The same interface as tests/nodes.py's LocalNodes (add, kill, node_of, remove_all_but,
shutdown), so the node-loss tests' helpers drive either. Use through the ``netns_nodes``
fixture (tests/conftest.py): one cluster per test module; each test adds its own worker nodes,
removed after it with their namespaces; the module's end removes the bridge, and checks that
nothing it made is left.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import ray

from cluster.nodes import local, netns
from cluster.nodes.kill import NodeNotFound, kill_node, node_processes

WAIT_S = 60.0


class NetnsNodes:
    def __init__(self, workdir: Path, *, system_config: dict | None = None) -> None:
        self.state = local.up([], [], workdir=workdir, use_netns=True, system_config=system_config)
        self.nodes: dict[str, str] = {}      # node id -> its name (node-1, ...), its namespace's
        self.labels: dict[str, dict] = {}    # node id -> its labels
        self._added = 0

    @property
    def address(self) -> str:
        return self.state.gcs_address

    @property
    def head_id(self) -> str:
        return self.state.head_id

    @property
    def net(self) -> netns.Net:
        return netns.from_dict(self.state.net)

    def connect(self) -> None:
        local.token_auth_on()
        ray.init(address=self.address, logging_level="WARNING")

    def add(self, *, num_cpus: float, labels: dict | None = None) -> str:
        """A new worker node in a namespace of its own; its node id, once the cluster lists it alive."""
        self._added += 1
        name, labels = f"node-{self._added}", dict(labels or {})
        local.start_worker(self.state, name, int(num_cpus), labels)
        node_id = self._wait(lambda n: n["Alive"] and n["Labels"].get(local.NODE_LABEL) == name, f"{name} joined")
        self.state.workers[node_id] = {local.NODE_LABEL: name, **labels}  # so local.stop finds it
        self.nodes[node_id], self.labels[node_id] = name, labels
        return node_id

    def ip(self, node_id: str) -> str:
        return self.net.node(self.nodes[node_id])["ip"]

    def alive(self, node_id: str) -> bool:
        return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())

    def wait_dead(self, node_id: str, timeout_s: float = WAIT_S) -> float:
        """Until the cluster lists the node dead; returns when (perf_counter)."""
        self._wait(lambda n: n["NodeID"] == node_id and not n["Alive"], "declared dead", timeout_s)
        return time.perf_counter()

    def _wait(self, match, what: str, timeout_s: float = WAIT_S) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            found = [n["NodeID"] for n in ray.nodes() if match(n)]
            if found:
                return found[0]
            if time.monotonic() > deadline:
                raise TimeoutError(f"no node {what} within {timeout_s:.0f}s")
            time.sleep(0.05)

    def cut(self, node_id: str) -> None:
        """Partition the node: its link down; its processes run on, unreachable."""
        netns.cut(self.net, self.nodes[node_id])

    def restore(self, node_id: str) -> None:
        netns.restore(self.net, self.nodes[node_id])

    def processes_gone(self, node_id: str, timeout_s: float = WAIT_S) -> bool:
        """Whether the node's raylet has exited (within ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                node_processes(node_id)
            except NodeNotFound:
                return True
            time.sleep(0.1)
        return False

    def kill(self, node_id: str) -> list[int]:
        """SIGKILL the node's raylet and every process it started."""
        return kill_node(node_id)

    def remove_all_but(self, keep: set[str]) -> None:
        """Stop the worker nodes added since ``keep`` was noted and remove their namespaces."""
        gone = [nid for nid in self.nodes if nid not in keep]
        for nid in gone:
            try:
                kill_node(nid)
            except NodeNotFound:  # exited already (declared dead while partitioned)
                pass
            netns.remove_node(self.net, self.nodes.pop(nid))
            del self.labels[nid], self.state.workers[nid]
        for nid in gone:
            self.wait_dead(nid)

    def node_of(self, labels: dict) -> str:
        ids = [nid for nid in self.nodes if labels.items() <= self.labels[nid].items()]
        assert len(ids) == 1, f"{len(ids)} nodes carry {labels}"
        return ids[0]

    def shutdown(self, connected: bool = True) -> list[str]:
        """Stop every process of the cluster and remove the bridge and namespaces; returns what of
        them is still there (nothing, or the caller fails)."""
        if connected:
            ray.shutdown()
        local.stop(self.state)
        shutil.rmtree(self.state.temp_dir, ignore_errors=True)
        return netns.leftovers(self.net) + [f"pid {p.pid}" for stage in local.processes(self.state) for p in stage]

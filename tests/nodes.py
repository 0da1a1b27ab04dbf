"""Several Ray nodes on one machine, the way Ray's own tests make them: a head and worker nodes,
each a raylet with its own object store (``ray.cluster_utils.Cluster``), with node labels
and the fast node-failure detection tether runs with (cluster/nodes/health.py).

The head node has no CPUs, so every actor that reserves one lands on a worker node and the
driver's process (on the head) shares no node with them. Use through the ``ray_nodes``
fixture (tests/conftest.py): one cluster per test module, this process connected to it; each
test adds its own worker nodes, and they are removed after it.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from cluster.nodes.health import NODE_FAILURE_DETECTION
from cluster.nodes.kill import kill_head, kill_node


class LocalNodes:
    def __init__(self, *, head_cpus: int = 0, system_config: dict | None = None) -> None:
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": head_cpus, "include_dashboard": False,
            "_system_config": {**NODE_FAILURE_DETECTION, **(system_config or {})}})
        self.nodes: dict[str, object] = {}   # node id -> the worker node's handle in Cluster
        self.labels: dict[str, dict] = {}    # node id -> its labels

    @property
    def address(self) -> str:
        return self.cluster.address

    @property
    def head_id(self) -> str:
        return self.cluster.head_node.node_id

    def add(self, *, num_cpus: float, labels: dict | None = None, wait: bool = True, connected: bool = True) -> str:
        """A new worker node; its node id. ``wait``: until the cluster lists it as alive (asked
        through this process's connection, or the GCS directly when not ``connected``)."""
        node = self.cluster.add_node(num_cpus=num_cpus, labels=dict(labels or {}), wait=wait and not connected)
        self.nodes[node.node_id], self.labels[node.node_id] = node, dict(labels or {})
        if wait and connected:
            self.wait_alive(node.node_id)
        return node.node_id

    def wait_alive(self, node_id: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {node_id} did not join within {timeout_s:.0f}s")
            time.sleep(0.05)

    def kill(self, node_id: str) -> list[int]:
        """SIGKILL the node's raylet and every process it started, found by its node id."""
        pids = kill_node(node_id)
        self.cluster.worker_nodes.discard(self.nodes.pop(node_id))  # so shutdown does not stop it again
        return pids

    def kill_head(self) -> list[int]:
        return kill_head(self.head_id)

    def remove_all_but(self, keep: set[str]) -> None:
        """Stop the worker nodes added since ``keep`` (node ids) was noted, and wait until the
        cluster lists each as dead: the next test on this cluster starts from the nodes it had."""
        gone = [nid for nid in self.nodes if nid not in keep]
        for nid in gone:
            self.cluster.remove_node(self.nodes.pop(nid))
            del self.labels[nid]
        deadline = time.monotonic() + 60.0
        while any(n["NodeID"] in gone and n["Alive"] for n in ray.nodes()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"removed nodes still listed alive after 60s: {gone}")
            time.sleep(0.05)

    def node_of(self, labels: dict) -> str:
        """The id of the one worker node carrying ``labels``."""
        ids = [nid for nid in self.nodes if labels.items() <= self.labels[nid].items()]
        assert len(ids) == 1, f"{len(ids)} nodes carry {labels}"
        return ids[0]

    def shutdown(self, connected: bool = True) -> None:
        if connected:
            ray.shutdown()
        self.cluster.shutdown()
        # Ray notes a started cluster's address for a later argument-less ray.init() to join;
        # this one is gone, so its note must not outlive it.
        note = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
        if note.is_file() and note.read_text().strip() == self.address:
            note.unlink()

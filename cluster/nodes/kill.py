"""Losing a whole Ray node on purpose: its raylet and every process the raylet started
(the workers that host actors, and the node's agents), all SIGKILLed at once.

The raylet is found by its own node id (it runs with ``--node_id=<hex>``), never by a process
name, so only that node's processes die, whatever else runs on the machine. The head node
also runs the GCS, which this does not touch (kill_head does).
"""
from __future__ import annotations

import os
import signal
import time

import psutil

DEATH_TIMEOUT_S = 10.0  # SIGKILL is delivered asynchronously; this long at most until each is gone


class NodeNotFound(LookupError):
    """No raylet of that node id runs on this machine."""


def raylet_of(node_id: str) -> psutil.Process:
    flag = f"--node_id={node_id}"
    for proc in psutil.process_iter(["cmdline"]):
        if flag in (proc.info["cmdline"] or ()):
            return proc
    raise NodeNotFound(f"no raylet of node {node_id} runs on this machine")


def node_processes(node_id: str) -> list[psutil.Process]:
    """The node's raylet first, then everything it started (workers, agents)."""
    raylet = raylet_of(node_id)
    return [raylet, *raylet.children(recursive=True)]


def kill_node(node_id: str) -> list[int]:
    """SIGKILL the node's raylet and all its descendants; returns their pids.

    The descendants are listed before anything dies (a dead raylet's children are re-parented
    and could no longer be told apart)."""
    return _kill_all([p.pid for p in node_processes(node_id)])


def gcs_of(node_id: str) -> psutil.Process:
    """The GCS server that runs on head node ``node_id`` (it runs with ``--node-id=<hex>``)."""
    flag = f"--node-id={node_id}"
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or ()
        if cmd and os.path.basename(cmd[0]) == "gcs_server" and flag in cmd:
            return proc
    raise NodeNotFound(f"no GCS server of head node {node_id} runs on this machine")


def kill_head(node_id: str) -> list[int]:
    """The head node's death: its GCS server and the node itself (kill_node), together."""
    return _kill_all([gcs_of(node_id).pid, *[p.pid for p in node_processes(node_id)]])


def _kill_all(pids: list[int]) -> list[int]:
    """SIGKILL each pid; return once all are dead (gone, or a zombie nobody reaped yet)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # exited on its own meanwhile
            pass
    deadline = time.monotonic() + DEATH_TIMEOUT_S
    while not all(map(_dead, pids)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return pids


def _dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True

"""Stopping what ``tether cluster up`` started, and nothing else (cluster/nodes/local.py).

The cluster's processes are found by node id (each raylet and its descendants, the GCS) and by
the sessions of our own ``ray start`` calls (the head's dashboard, monitor, log monitors, which
name this cluster's temp dir). They stop in `ray stop`'s order: raylets, the rest, the GCS
last. With ``--netns`` the namespaces, links and bridge the cluster was given go too. ``state``
is cluster/nodes/local.py's ``State`` (read by attribute, so this module needs not import it).
"""
from __future__ import annotations

import os
import time

import psutil

from cluster.nodes import netns
from cluster.nodes.kill import NodeNotFound, gcs_of, node_processes

STOP_GRACE_S = 5.0                      # SIGTERM -> SIGKILL, per stage of `down`
KILL_WAIT_S = 10.0


def processes(state) -> tuple[list, list, list]:
    """(raylets, everything else, the GCS) of the cluster, as running now."""
    raylets, rest = [], {}
    for node_id in filter(None, [state.head_id, *state.workers]):
        try:
            raylet, *descendants = node_processes(node_id)
        except NodeNotFound:
            continue
        raylets.append(raylet)
        rest.update((p.pid, p) for p in descendants)
    try:
        gcs = [gcs_of(state.head_id)] if state.head_id else []
    except NodeNotFound:
        gcs = []
    for proc in _session_members(state) + _in_namespaces(state):
        rest.setdefault(proc.pid, proc)
        for child in _children(proc):
            rest.setdefault(child.pid, child)
    skip = {p.pid for p in raylets + gcs} | {os.getpid()}
    return raylets, [p for pid, p in rest.items() if pid not in skip], gcs


def _session_members(state) -> list[psutil.Process]:
    """Processes in the session of one of our `ray start`s that name this cluster (its temp
    dir or GCS address): the head's dashboard, monitor, client server, the log monitors."""
    marks = [m for m in (state.temp_dir, state.gcs_address) if m]
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if os.getsid(proc.pid) not in state.sessions:
                continue
        except OSError:
            continue
        cmdline = " ".join(proc.info["cmdline"] or ())
        if any(m in cmdline for m in marks):
            found.append(proc)
    return found


def _in_namespaces(state) -> list[psutil.Process]:
    """Whatever runs in the cluster's namespaces: found even when no node id was recorded yet."""
    net, found = netns.from_dict(state.net), []
    for pid in netns.pids(net) if net else []:
        try:
            found.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    return found


def _children(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def stop(state) -> list[int]:
    """Stop the cluster's processes in `ray stop`'s order (raylets, the rest, the GCS last):
    SIGTERM, then SIGKILL to what is left after STOP_GRACE_S; then remove its namespaces, links
    and bridge, if it had them. Returns the pids stopped. Safe to repeat."""
    stages = processes(state)
    for stage in stages:
        _terminate(stage)
    net = netns.from_dict(state.net)
    if net is not None:
        netns.remove(net)
    return [p.pid for stage in stages for p in stage]


def _terminate(procs: list[psutil.Process]) -> None:
    for signal_name, wait_s in (("terminate", STOP_GRACE_S), ("kill", KILL_WAIT_S)):
        left = [p for p in procs if not _gone(p)]
        for proc in left:
            try:
                getattr(proc, signal_name)()  # psutil checks the pid was not reused
            except psutil.NoSuchProcess:
                pass
        deadline = time.monotonic() + wait_s
        while left and time.monotonic() < deadline:
            left = [p for p in left if not _gone(p)]
            time.sleep(0.05)
        if not left:
            return


def _gone(proc: psutil.Process) -> bool:
    """Exited, or a zombie (our init may be slow to reap)."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def running(state) -> bool:
    """Whether anything of the cluster is left: a process, or a namespace or link it was given."""
    net = netns.from_dict(state.net)
    return any(processes(state)) or bool(net and netns.leftovers(net))

"""Peak resident memory of a process tree, by role: what each actor held at its worst.

A thread polls /proc every `interval` seconds for the descendants of one process (a
cluster.train or TRL subprocess: Ray's local cluster, its workers and vLLM's engine
process are all below it) and keeps each one's VmHWM, the kernel's own peak-RSS mark, so
only a process that appears and exits between two polls is missed. Ray names its worker
processes after the actor ("ray::Generator.sample"); a process without such a name counts
towards its nearest named ancestor (vLLM's engine core towards its Generator).
"""
from __future__ import annotations

import os
import threading
from collections import defaultdict


def _read(pid: int, name: str) -> str:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _status_bytes(pid: int, key: str) -> int:
    for line in _read(pid, "status").splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return 0


def rss_bytes(pid: int) -> int:
    """VmRSS (resident memory now) of one live process in bytes; 0 once it is gone."""
    return _status_bytes(pid, "VmRSS:")


def peak_rss_bytes(pid: int) -> int:
    """VmHWM (the kernel's peak-RSS mark) of one live process in bytes; 0 once it is gone."""
    return _status_bytes(pid, "VmHWM:")


def _children() -> dict[int, list[int]]:
    tree = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _read(int(entry), "stat")
            if stat:  # "pid (comm) state ppid ...": comm may hold spaces, so split after ')'
                tree[int(stat.rsplit(")", 1)[1].split()[1])].append(int(entry))
    return tree


RAY_AGENTS = ("DashboardAgent", "RuntimeEnvAgent")


def _label(pid: int) -> str | None:
    argv = _read(pid, "cmdline").split("\0")
    head = argv[0].strip() if argv else ""
    if head.startswith("ray::"):
        name = head[5:].split(".")[0].split(" ")[0].rsplit(":", 1)[-1]  # "[actor-name:]Class.method"
        return None if name in ("IDLE", "") else "ray system" if name in RAY_AGENTS else name
    return None


class PeakMemory:
    """with PeakMemory(root_pid) as mem: ...; mem.by_role() -> {role: peak bytes}."""

    def __init__(self, root_pid: int, interval: float = 0.5, root_label: str = "driver") -> None:
        self.root, self.interval, self.root_label = root_pid, interval, root_label
        self.peak: dict[int, int] = {}
        self.group: dict[int, tuple[str, int]] = {}  # pid -> (role, pid of the actor it belongs to)
        self.group_peak: dict[tuple, int] = {}       # the most its live processes held together at a poll
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "PeakMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.poll()
            if self._stop.wait(self.interval):
                return

    def poll(self) -> None:
        tree, stack = _children(), [(self.root, (self.root_label, self.root))]
        now: dict[tuple, int] = defaultdict(int)
        while stack:
            pid, inherited = stack.pop()
            own = _label(pid)
            if own is not None and own == inherited[0]:
                group = inherited               # forked by its actor and still carrying its title
            elif own is not None:
                group = (own, pid)              # an actor's own process
            elif pid in self.group and self.group[pid][0] != self.root_label:
                group = self.group[pid]         # keep a label seen before (an actor between calls)
            elif inherited[0] == self.root_label and pid != self.root and "ray" in _read(pid, "cmdline"):
                group = ("ray system", pid)     # gcs_server, raylet, dashboard, idle workers
            else:
                group = inherited               # a helper (vLLM's engine core): its parent's
            self.group[pid] = group
            self.peak[pid] = max(self.peak.get(pid, 0), peak_rss_bytes(pid))
            now[group] += _status_bytes(pid, "VmRSS:")
            stack.extend((child, group) for child in tree.get(pid, ()))
        for group, rss in now.items():
            self.group_peak[group] = max(self.group_peak.get(group, 0), rss)

    def by_role(self) -> dict[str, dict]:
        """{role: {"peak_rss_bytes": ..., "processes": actors}}. One actor is its process plus its
        helpers (vLLM's engine core and workers): the most they held together at one poll, or
        the actor process's own VmHWM if larger. A role with several actors (learner ranks)
        shows the largest; "ray system" (Ray's daemons, agents, idle workers) is the sum."""
        out: dict[str, dict] = {}
        for (role, root), peak in self.group_peak.items():
            peak = max(peak, self.peak.get(root, 0) if role != "ray system" else 0)
            entry = out.setdefault(role, {"peak_rss_bytes": 0, "processes": 0})
            entry["processes"] += 1
            entry["peak_rss_bytes"] = (entry["peak_rss_bytes"] + peak if role == "ray system"
                                       else max(entry["peak_rss_bytes"], peak))
        return out


def tree_peak_rss_bytes(pid: int) -> int:
    """VmHWM of a live process plus its live descendants' (vLLM's engine core): each one's own
    peak, summed, so an upper bound on what they held together."""
    tree, stack, total = _children(), [pid], 0
    while stack:
        p = stack.pop()
        total += peak_rss_bytes(p)
        stack.extend(tree.get(p, ()))
    return total

"""An actor's thread count, fitted to the cores its own node gives it.

The driver plans each actor's OMP_NUM_THREADS from the cluster's view of its nodes
(cluster/runtime/pools/threads.py). A node's advertised CPUs can exceed the cores its processes
may use (several raylets on one machine, a container's cpuset): vLLM's CPU attention then
refuses to run with more threads than it can bind, and torch oversubscribes. Each actor
calls fit_threads() first thing in its constructor, on its own node.
"""
from __future__ import annotations

import contextlib
import os


def fit_threads() -> int:
    """Lower OMP_NUM_THREADS (and torch's intra-op threads) to this process's usable cores;
    returns the count in force."""
    cores = len(os.sched_getaffinity(0))
    planned = int(os.environ.get("OMP_NUM_THREADS") or cores)
    threads = max(1, min(planned, cores))
    if threads != planned:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        import torch

        torch.set_num_threads(threads)
    return threads


@contextlib.contextmanager
def torch_threads(threads: int):
    """torch's intra-op threads set to ``threads`` inside the block (0: left as they are): an
    actor whose one call runs beside other work on the node (the learner scoring the reference
    while the reward model scores) takes its share of the cores for that call only."""
    import torch

    before = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(min(threads, before))
    try:
        yield
    finally:
        torch.set_num_threads(before)

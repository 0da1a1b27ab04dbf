"""Several raylets on one machine, and a whole node's loss by its node id: only that node's
processes die, and Ray declares it dead within the tuned detection time."""
import os
import time

import psutil
import pytest
import ray

from cluster.nodes.health import NODE_FAILURE_DETECTION
from cluster.nodes.kill import NodeNotFound, kill_node, node_processes

pytestmark = pytest.mark.integration

RAY_DEFAULT_PERIOD_S, RAY_DEFAULT_THRESHOLD = 3, 5  # Ray's own health_check_period_ms / failure_threshold


@ray.remote(num_cpus=1)
class Where:
    def node(self):
        return ray.get_runtime_context().get_node_id(), os.getpid()


def _dead(pid: int) -> bool:
    """Gone, or a zombie (this process started the raylet, and has not reaped it yet)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _on(label):
    return Where.options(label_selector={"tether.test": label}).remote()


def test_node_kill_takes_exactly_that_node(ray_nodes):
    a, b = (ray_nodes.add(num_cpus=1, labels={"tether.test": x}) for x in "ab")
    actor_a, actor_b = _on("a"), _on("b")
    (node_a, pid_a), (node_b, pid_b) = ray.get([actor_a.node.remote(), actor_b.node.remote()])
    assert (node_a, node_b) == (a, b)  # each its own raylet, placed by label
    assert pid_a in [p.pid for p in node_processes(a)] and pid_b not in [p.pid for p in node_processes(a)]

    killed = ray_nodes.kill(a)  # returns once every process of the node is dead
    t0 = time.monotonic()
    assert pid_a in killed and all(_dead(pid) for pid in killed)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor_a.node.remote(), timeout=60)
    # Ray's tuned detection is a wall-clock matter (checks 1 s apart, 3 missed: ~4 s on any
    # machine); its defaults (3 s apart, 5 missed) take 15 s or more. Timed from the node's
    # death, not from before the kill, a machine 3x slower or faster still falls between.
    default = RAY_DEFAULT_PERIOD_S * RAY_DEFAULT_THRESHOLD
    assert NODE_FAILURE_DETECTION["health_check_period_ms"] * NODE_FAILURE_DETECTION[
        "health_check_failure_threshold"] / 1000 * 3 < default
    while next(n for n in ray.nodes() if n["NodeID"] == a)["Alive"]:
        assert time.monotonic() - t0 < default, f"node {a} still counted alive {default:.0f}s after its loss"
        time.sleep(0.05)
    assert ray.get(actor_b.node.remote()) == (b, pid_b)  # the other node never noticed
    with pytest.raises(NodeNotFound):
        kill_node(a)


def test_actor_threads_fit_the_cores_of_a_node_that_advertises_more(ray_nodes):
    """A node may advertise more CPUs than its processes can use (several raylets on one
    machine): the threads planned from its CPUs are cut to the cores there (vLLM's CPU
    attention refuses more threads than it can bind)."""
    from cluster.runtime.threads import thread_env
    from core.threads import fit_threads

    cores = len(os.sched_getaffinity(0))
    ray_nodes.add(num_cpus=cores + 2, labels={"tether.test": "big"})

    def threads():
        import torch
        return fit_threads(), int(os.environ["OMP_NUM_THREADS"]), torch.get_num_threads()

    probe = ray.remote(num_cpus=1)(threads).options(label_selector={"tether.test": "big"},
                                                    runtime_env={"env_vars": thread_env(cores + 2)})
    assert ray.get(probe.remote()) == (cores, cores, cores)

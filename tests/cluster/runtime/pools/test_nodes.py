"""Several raylets on one machine, and a whole node's loss by its node id: only that node's
processes die, and Ray declares it dead within the tuned detection time."""
import os
import threading
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
    from cluster.runtime.pools.threads import thread_env
    from core.infra.threads import fit_threads

    cores = len(os.sched_getaffinity(0))
    ray_nodes.add(num_cpus=cores + 2, labels={"tether.test": "big"})

    def threads():
        import torch
        return fit_threads(), int(os.environ["OMP_NUM_THREADS"]), torch.get_num_threads()

    probe = ray.remote(num_cpus=1)(threads).options(label_selector={"tether.test": "big"},
                                                    runtime_env={"env_vars": thread_env(cores + 2)})
    assert ray.get(probe.remote()) == (cores, cores, cores)


def test_a_learner_rank_lost_with_its_node_and_no_room_left_fails_placement_in_one_line(ray_nodes, policy_path):
    """The learner's only node is lost and no other node carries its label: restart() gives up
    after the placement timeout with LearnerPlacementError's one line (the fix named), instead
    of starting ranks that wait for a node that will not come (until the start timeout)."""
    from cluster.runtime.pools.pool import reserve
    from learner.group import LearnerGroup, LearnerPlacementError, LearnerRankDied

    node = ray_nodes.add(num_cpus=1, labels={"tether.test": "learn"})
    ray_nodes.add(num_cpus=1, labels={"tether.test": "other"})  # room, but not the learner's
    pg = reserve("learner", 1, 1, 0, 60, labels={"tether.test": "learn"})
    group = LearnerGroup(model=policy_path, config={"zero_stage": 0}, world_size=1, placement_group=pg)
    group.start_timeout_s = 120  # bounds only a start that waits for the node (the failure pinned here)
    ray_nodes.kill(node)
    with pytest.raises(LearnerRankDied):
        group.health()
    deadline = time.monotonic() + 120
    while next(n for n in ray.nodes() if n["NodeID"] == node)["Alive"]:  # until Ray re-places its bundle
        assert time.monotonic() < deadline, f"node {node} never declared dead"
        time.sleep(0.05)
    with pytest.raises(LearnerPlacementError) as failed:
        group.restart(placement_timeout_s=3)
    message = str(failed.value)
    assert "\n" not in message and "within 3s" in message and "add a node with room" in message, message
    group.shutdown()
    ray.util.remove_placement_group(pg)


class _Pools:
    """What start_control reads of the run's pools: their sizes, and the list its actor joins."""

    def __init__(self):
        self.extra_actors = []

    def sizes(self):
        return {"generator": 1}


@pytest.mark.integration
def test_the_control_actor_sits_beside_the_driver_and_outlives_every_worker_node(ray_nodes, tmp_path):
    """Ray puts a 0-CPU actor on any node (a worker node 10 times in 12 here, without a rule): the
    run's control actor, which the driver calls between every two steps, goes on the driver's
    node, so losing any other node cannot end the run through it; a scale request it holds is kept."""
    from cluster.runtime.service import start_control

    workers = [ray_nodes.add(num_cpus=1, labels={"tether.test": f"w{i}"}) for i in range(3)]
    here = ray.get_runtime_context().get_node_id()
    pools, controls = _Pools(), []
    try:
        for i in range(3):
            control, _ = start_control(tmp_path / f"run{i}", pools)
            controls.append(control)
            ray.get(control.request.remote({"generator": 2}))
        beside = {p.pid for p in node_processes(here)}  # found by the driver's node id
        assert all(ray.get(c.health.remote())["pid"] in beside for c in controls)
        for node in workers:
            ray_nodes.kill(node)
        assert all(ray.get(c.pending.remote(), timeout=60) == {"generator": 2} for c in controls)
    finally:
        for actor in pools.extra_actors:
            ray.kill(actor)


@pytest.mark.integration
def test_rays_node_death_banner_goes_to_library_log(ray_nodes, capfd, tmp_path, monkeypatch):
    """A node SIGKILLed and marked dead: Ray's multi-line banner for it goes to the run's
    library.log, not the console, where tether's own line says what the node carried."""
    import logging

    import ray._private.worker as ray_worker

    from cluster.runtime.observe.console import LIBRARY_LOG, NODE_DIED, quiet_console
    from cluster.runtime.pools.pool import QUIET_ENV

    for name, value in QUIET_ENV.items():  # quiet_console sets them in the process: undone after the test
        monkeypatch.setenv(name, value)
    node = ray_nodes.add(num_cpus=1, labels={"tether.test": "doomed"})

    class Written(logging.Handler):  # after the library log's handler: set once this node's banner is written
        def __init__(self):
            super().__init__()
            self.event = threading.Event()

        def emit(self, record):
            if NODE_DIED in record.getMessage() and node in record.getMessage():
                self.event.set()

    written, ray_logger = Written(), logging.getLogger("ray")
    with quiet_console(library_logs=False) as library:
        library.open(tmp_path)
        ray_logger.addHandler(written)
        try:
            ray_nodes.kill(node)
            # Ray's driver prints the banner from a thread of its own once the GCS marks the node dead.
            assert written.event.wait(120), "no node-death banner within 120 s of the kill"
        finally:
            ray_logger.removeHandler(written)
    assert ray_worker.print_to_stdstream.__name__ != "print_or_log"  # Ray's own printer is back
    out, logged = capfd.readouterr(), (tmp_path / LIBRARY_LOG).read_text()
    assert NODE_DIED not in out.out + out.err and f"{NODE_DIED} because" in logged and node in logged, (out, logged)

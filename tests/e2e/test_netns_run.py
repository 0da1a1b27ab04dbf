"""The PPO service across Ray nodes that have addresses of their own (network namespaces on a
bridge: tests/netns_nodes.py, the code of `tether cluster up --netns`), and a node cut off the
network while it carries roles, then brought back.

A 2-rank learner spread over two nodes (its rendezvous and gloo traffic on the nodes'
addresses), the generator, the reward and the buffer each elsewhere, so rollouts, shards and
every weight push cross the bridge as real TCP between distinct addresses. Every object goes
to an object store (none inline in its owner's reply), as a real model's would.
"""
import threading
import time

import pytest
import ray
from accounting import Accounting
from jobs import rows
from node_runs import STORED, on_call, print_rates, pull_rates, split_run

from cluster.nodes.ports import wait_listening

pytestmark = pytest.mark.e2e

NETNS_SYSTEM_CONFIG = STORED
BLIP_S = 1.0  # a partition shorter than Ray's detection window (3 missed 1 s health checks)


@pytest.fixture
def run(netns_nodes, tmp_path):
    runs = []

    def make(*overrides):
        runs.append(split_run(netns_nodes, tmp_path, *overrides))
        return runs[-1]

    yield make
    for r in runs:
        r.close()


class Partition:
    """Cut a node's link; once Ray has declared it dead (polled), restore it. Times in perf_counter."""

    def __init__(self, nodes, node_id: str) -> None:
        self.nodes, self.node_id, self.times = nodes, node_id, {}
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        """Cut now, in the caller (ahead of the call it is hooked to: on_call), then watch."""
        self.times["cut"] = time.perf_counter()
        self.nodes.cut(self.node_id)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.times["declared"] = self.nodes.wait_dead(self.node_id)
        finally:
            self.nodes.restore(self.node_id)
            self.times["restored"] = time.perf_counter()

    def join(self, timeout_s: float = 120.0) -> dict:
        self.thread.join(timeout_s)
        assert "restored" in self.times and "declared" in self.times, f"partition incomplete: {self.times}"
        return self.times


def time_steps(c) -> list[tuple[int, float]]:
    """(step, perf_counter) of every step's row as it is logged (a redone step again)."""
    logged, log_row = [], c.metrics.log

    def log_and_time(step, metrics):
        logged.append((step, time.perf_counter()))
        return log_row(step, metrics)

    c.metrics.log = log_and_time
    return logged


def next_step_after(logged: list[tuple[int, float]], t: float) -> float:
    return min(at for _, at in logged if at > t) - t


def blip(nodes, node_id: str) -> None:
    nodes.cut(node_id)
    time.sleep(BLIP_S)  # the blip's length is the stimulus
    nodes.restore(node_id)


@pytest.mark.timeout(1200)
def test_a_partition_of_a_learner_rank_and_the_reference_is_survived_once(run, netns_nodes):
    """Step 1: the learner's ranks meet on their nodes' own addresses, and a 1 s blip of the
    generator's link mid-generation is ridden through (no replacement, no rollback). Step 2: the
    node of a learner rank and the reference is cut off while the learner trains and kept off
    until Ray declares it dead: the run rolls back to step 1's checkpoint, the rank and the
    reference start again on the spare, and when the node's link comes back its raylet exits
    and nothing it computed is used: every prompt trained once, each step once."""
    c = run("run.steps=3", "run.checkpoint_every=1")
    ids, account = c.ids, Accounting(c.driver)
    account.follow_rollbacks(c.driver)
    ranks = c.pools.learner.workers

    def rank_view(objective, _):  # nested: pickled by value, run inside the rank's process
        import os
        return {"ip": ray.util.get_node_ip_address(), "master": os.environ.get("MASTER_ADDR"),
                "gloo": os.environ.get("GLOO_SOCKET_IFNAME")}

    views = ray.get([w.apply.remote(rank_view, None) for w in ranks])
    gen = c.pools.generators.first()  # vLLM's own address is the node's, not a failed public lookup
    assert ray.get(gen.__ray_call__.remote(lambda _: __import__("os").environ.get("VLLM_HOST_IP"))) == \
        netns_nodes.ip(ids["gen"])
    assert {c.where(w) for w in ranks} == {ids["pair"], ids["rank"]}, "the ranks share a node"
    assert {v["ip"] for v in views} == {netns_nodes.ip(ids["pair"]), netns_nodes.ip(ids["rank"])}
    assert views[1]["master"] == views[0]["ip"] and {v["gloo"] for v in views} == {"eth0"}, views
    pair_rank = next(r for r, w in enumerate(ranks) if c.where(w) == ids["pair"])
    for node in ray.nodes():  # every node's Prometheus endpoint answers on its own address
        if node["Alive"]:
            assert wait_listening(node["MetricsExportPort"], 10, host=node["NodeManagerAddress"]), node

    generating = threading.Thread(target=blip, args=(netns_nodes, ids["gen"]))
    on_call(c.driver.rollouts, "_score", 1, generating.start)  # while the step's other chunks generate
    partition = Partition(netns_nodes, ids["pair"])
    on_call(c.pools.learner, "train", 2, partition.start)  # step 2's update starts with the node cut
    logged = time_steps(c)
    c.driver.run()
    generating.join(30)
    times = partition.join()

    steps = [r for r in rows(c.metrics.run_dir) if r["step"]]
    assert c.driver.step_count == 3 and [r["step"] for r in steps] == [1, 2, 3]
    assert account.lost_and_twice() == (0, 0) and len(account.trained) == 3 * 64
    [rb] = c.driver.rollbacks
    assert (rb["rank"], rb["failed_at_step"], rb["resumed_at_step"]) == (pair_rank, 1, 1)
    roles = {r["role"] for r in c.driver.rollouts.recoveries}
    assert roles == {"reference"}, roles  # the blip replaced nothing; the generator still serves
    assert netns_nodes.alive(ids["gen"]) and c.where(c.pools.generators.first()) == ids["gen"]
    assert c.where(c.pools.references.first()) == c.spare
    assert {c.where(w) for w in c.pools.learner.workers} == {ids["rank"], c.spare}
    # The returning node: Ray keeps it dead, and its raylet exits on hearing so.
    assert not netns_nodes.alive(ids["pair"]) and netns_nodes.processes_gone(ids["pair"])
    for r in steps:  # every step pulled across the bridge and pushed its weights to another node
        assert r["transfer/cross_node_bytes"] > 0 and r["perf/sync_bytes"] > 0
    assert steps[-1]["ppo/logprob_gap_mean"] < 1e-3  # the generator has the learner's weights
    reference = next(r for r in c.driver.rollouts.recoveries if r["role"] == "reference")
    print(f"\npartition of {{learner rank {pair_rank}, reference}}: declared dead "
          f"{times['declared'] - times['cut']:.2f}s after the cut, rollback detected "
          f"{rb['detected_at'] - times['cut']:.2f}s after it, learner recovered {rb['recovery_seconds']:.2f}s later; "
          f"reference detected {reference['detected'] - times['cut']:.2f}s after the cut, serving "
          f"{reference['serving'] - reference['detected']:.2f}s later; the next step done "
          f"{next_step_after(logged, times['cut']):.2f}s after the cut")
    print_rates(steps)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_transfer_rates_across_the_bridge(run):
    """docs/performance.md's rates between nodes with addresses of their own (no fault); the same
    run on nodes sharing one address: tests/e2e/test_node_loss.py::test_transfer_rates_on_one_address."""
    c = run("run.steps=4")
    c.driver.run()
    print_rates([r for r in rows(c.metrics.run_dir) if r["step"]])
    rates = pull_rates(c.ids["gen"], c.ids["rb"])
    print("64 MB object pulled between two nodes: " + ", ".join(f"{r / 1e6:.0f}" for r in rates) + " MB/s")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_partitions_at_each_phase(netns_nodes, tmp_path):
    """The phase matrix beside the default tier's partition during the update: the generator's
    node cut while it generates, the reward's and buffer's while scoring, and rank 0's node
    during the weight push; each kept off until Ray declares it dead, then restored. Every
    prompt is trained once and each step once. Prints the detection and recovery times."""
    from node_runs import SPLIT, SPLIT_NODES, SPREAD_LEARNER, Cluster

    from cluster.runtime.loop.ledger import ChunkState

    c = Cluster(netns_nodes, tmp_path, *SPREAD_LEARNER, "run.steps=4", "run.checkpoint_every=1",
                **{**SPLIT, "spare_for": tuple(SPLIT_NODES)})
    try:
        account, table = Accounting(c.driver), []
        account.follow_rollbacks(c.driver)
        rank0_node = next(n for n in ("pair", "rank") if c.where(c.pools.learner.workers[0]) == c.ids[n])
        partitions = {"gen": Partition(netns_nodes, c.ids["gen"]), "rb": Partition(netns_nodes, c.ids["rb"]),
                      rank0_node: Partition(netns_nodes, c.ids[rank0_node])}
        generating = threading.Event()

        def watch():  # step 1: cut the generator's node once a chunk is generating
            while not generating.is_set():
                if any(ch.state is ChunkState.GENERATING for ch in c.driver.rollouts.ledger.in_flight()):
                    generating.set()
                    partitions["gen"].start()
                time.sleep(0.002)

        threading.Thread(target=watch, daemon=True).start()
        logged = time_steps(c)
        on_call(c.driver.rollouts, "_score", 5, partitions["rb"].start)  # step 2 (or a redo), scoring
        on_call(c.pools.learner, "push_weights", 3, partitions[rank0_node].start)  # a later push
        c.driver.run()
        generating.set()
        for name, part in partitions.items():
            times = part.join()
            table.append((name, times["declared"] - times["cut"], next_step_after(logged, times["cut"])))
        steps = [r["step"] for r in rows(c.metrics.run_dir) if r["step"]]
        assert c.driver.step_count == 4 and steps == [1, 2, 3, 4]
        assert account.lost_and_twice() == (0, 0) and len(account.trained) == 4 * 64
        print("\n| node cut | declared dead after (s) | next step done after (s) |\n|---|---|---|")
        for name, declared, next_step in table:
            print(f"| {name} | {declared:.2f} | {next_step:.2f} |")
        for r in c.driver.rollouts.recoveries:
            print(f"{r['role']}: replacement serving {r['serving'] - r['detected']:.2f}s after detection")
        for rb in c.driver.rollbacks:
            print(f"rollback at step {rb['failed_at_step']}: recovered in {rb['recovery_seconds']:.2f}s")
    finally:
        c.close()

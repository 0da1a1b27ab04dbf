"""Placement by node on a real multi-node Ray (tests/nodes.py): a pool's node_labels pin its
replicas, spread against pack, the one-line error when no node carries the label, the buffer's
labels, and where each actor landed. Pools start a tiny actor (the Pool's contract: a
``start`` callable making an actor with ``health()``), not the models."""
import time
from types import SimpleNamespace

import pytest
import ray

from cluster.runtime.pools.placement import actor_nodes, actors_line, ask_nodes
from cluster.runtime.pools.pool import BufferSlot, PlacementError, Pool, Pools, free_placement, reserve
from core.infra.placement import group_nodes, on_bundle

pytestmark = pytest.mark.integration
GEN = {"tether.pool": "gen"}


@ray.remote(num_cpus=1)
class Tiny:
    def health(self):
        return {"ok": True, "node_id": ray.get_runtime_context().get_node_id()}


def tiny_pool(role="generator", *, timeout_s=30.0, **placement) -> Pool:
    return Pool(role, start=lambda rid, index, options: Tiny.options(name=rid, **options).remote(),
                num_cpus=1.0, num_gpus=0, placement_timeout_s=timeout_s, **placement)


def nodes_of(pool: Pool) -> list[str]:
    return sorted(h["node_id"] for h in ray.get([h.health.remote() for h in pool.handles().values()], timeout=60))


def all_free(cpus: float, timeout_s: float = 30.0) -> None:
    """Until the cluster has ``cpus`` CPUs free again (removed groups free theirs a moment later)."""
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0) < cpus:
        assert time.monotonic() < deadline, f"CPUs still held: {ray.available_resources()}"
        time.sleep(0.05)


def test_labels_pin_a_pool_to_its_node(ray_nodes):
    gen = ray_nodes.add(num_cpus=2, labels=GEN)
    ray_nodes.add(num_cpus=2, labels={"tether.pool": "other"})
    pool = tiny_pool(node_labels="tether.pool=gen")
    try:
        pool.add(2)
        assert nodes_of(pool) == [gen, gen]  # both on the labelled node, none on the other
    finally:
        pool.shutdown()


def test_spread_puts_replicas_on_two_nodes_where_pack_puts_them_on_one(ray_nodes):
    a, b = ray_nodes.add(num_cpus=2, labels=GEN), ray_nodes.add(num_cpus=2, labels=GEN)
    packed = tiny_pool(node_labels="tether.pool=gen")
    t0 = time.monotonic()
    packed.add(2)
    healthy = time.monotonic() - t0  # two replicas placed and started, on this machine
    assert len(set(nodes_of(packed))) == 1
    packed.shutdown()
    all_free(4)
    # A placement timeout far beyond a healthy placement here: only waiting it out comes near it.
    wait_s = 30 + 10 * healthy
    spread = tiny_pool(node_labels="tether.pool=gen", strategy="spread", timeout_s=wait_s)
    blocker = None
    try:
        spread.add(2)
        assert nodes_of(spread) == sorted([a, b])
        # The node holding the fewest of the pool's replicas has no room: the next one goes elsewhere, at once.
        on_a = next(rid for rid, h in spread.handles().items() if ray.get(h.health.remote())["node_id"] == a)
        spread.remove(on_a)
        assert set(spread.replica_nodes()) == {int(rid.rsplit("-", 1)[1]) for rid in spread.handles()}
        all_free(3)
        blocker = reserve("blocker", 1, 2, 0, 30, labels={"ray.io/node-id": a})
        t0 = time.monotonic()
        spread.add(1)
        took = time.monotonic() - t0
        print(f"\nplaced elsewhere in {took:.2f}s (a healthy placement of two: {healthy:.2f}s)")
        assert took < wait_s / 2 and nodes_of(spread) == [b, b], (took, healthy)  # at once, not after a's timeout
    finally:
        spread.shutdown()
        free_placement(blocker)
    all_free(4)
    # The learner's one group: spread is Ray's SPREAD over the labelled nodes.
    group = reserve("learner", 2, 1, 0, 30, labels=GEN, strategy="spread")
    assert sorted(group_nodes(group).values()) == sorted([a, b])
    free_placement(group)


def test_no_node_with_the_label_fails_in_one_line_within_the_timeout(ray_nodes):
    ray_nodes.add(num_cpus=1, labels=GEN)
    healthy = tiny_pool("reference", timeout_s=30, node_labels="tether.pool=gen")
    t0 = time.monotonic()
    healthy.add(1)
    placed = time.monotonic() - t0  # a placement that succeeds, the actor started, on this machine
    healthy.shutdown()
    all_free(1)
    t0 = time.monotonic()
    with pytest.raises(PlacementError) as e:
        tiny_pool("reward", timeout_s=2, node_labels="tether.pool=score").add(1)
    message = str(e.value)
    took = time.monotonic() - t0
    print(f"\nrefused in {took:.2f}s (a placement that succeeds: {placed:.2f}s)")
    # The 2 s timeout, then the message: less than a placement that succeeds takes, whatever the machine.
    assert took < 2 + placed and "\n" not in message, (took, placed)
    assert message.startswith("pool reward: cannot place 1 replica(s) x {'CPU': 1.0} on nodes labelled "
                              "tether.pool=score within 2s (no alive node carries that label; nodes: ")
    assert "[tether.pool=gen]" in message and message.endswith(
        "fix reward.node_labels or start a node with --labels tether.pool=score")
    with pytest.raises(PlacementError, match=r"^pool learner: .* tether.pool=score .* learner.node_labels"):
        reserve("learner", 2, 1, 0, 2, labels={"tether.pool": "score"})
    with pytest.raises(PlacementError, match=r"^pool generator: .*no room on [0-9a-f]{8}\[tether.pool=gen\]"):
        tiny_pool(timeout_s=2, node_labels="tether.pool=gen").add(2)  # the labelled node holds one
    with pytest.raises(PlacementError, match=r"^pool buffer: .*no alive node carries .*fix buffer.node_labels"):
        BufferSlot(capacity=4, env={}, node_labels="tether.pool=score", placement_timeout_s=2)


def test_buffer_and_every_actor_report_their_node(ray_nodes):
    gen, buf = ray_nodes.add(num_cpus=2, labels=GEN), ray_nodes.add(num_cpus=1, labels={"tether.pool": "buf"})
    slot = BufferSlot(capacity=4, env={}, node_labels="tether.pool=buf")
    generators, learner_pg = tiny_pool(node_labels="tether.pool=gen"), reserve("learner", 1, 1, 0, 30, labels=GEN)
    try:
        assert ask_nodes({slot.id: slot.handle}) == {"buffer-0": buf}
        assert slot.replace(slot.id) and ask_nodes({slot.id: slot.handle}) == {"buffer-1": buf}  # again there
        generators.add(1)
        rank = Tiny.options(**on_bundle(learner_pg, 0)).remote()
        empty = tiny_pool("reference")
        pools = Pools(generators, empty, tiny_pool("reward"), learner=SimpleNamespace(workers=[rank]),
                      buffer_slot=slot, learner_placement=learner_pg)
        nodes = actor_nodes(pools)
        assert {k: v["node_id"] for k, v in nodes.items()} == {"generator-0": gen, "learner-0": gen, "buffer-1": buf}
        assert nodes["buffer-1"]["labels"] == {"tether.pool": "buf"}
        assert actors_line(nodes) == (f"generator-0@{gen[:8]}[tether.pool=gen], learner-0@{gen[:8]}[tether.pool=gen], "
                                      f"buffer-1@{buf[:8]}[tether.pool=buf]")
    finally:
        generators.shutdown()
        slot.shutdown()
        free_placement(learner_pg)

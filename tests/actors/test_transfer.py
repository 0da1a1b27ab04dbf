"""Object transfer between nodes, measured by the consumer that pulls its inputs (core/infra/transfer.py),
on several raylets of this machine, each with its own object store (tests/nodes.py).

An object made on node A and pulled on node B counts its bytes as cross-node, with the
seconds of the pull; pulled on A (or again on B, which has a copy now) it counts as local.
An object small enough to travel inline comes inside the call: it counts by the node it
was sent from. The buffer reports what its put_chunk pulled, and a put whose input was lost
with its node fails as lost, storing nothing.
"""
import sys

import numpy as np
import pytest
import ray
from ray.exceptions import ObjectLostError, RayTaskError

from core.infra.transfer import Pull, Transfer, pull_args

pytestmark = pytest.mark.integration

# Ray workers cannot import this test module; ship its helpers (Peer) by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

BIG = 2_000_000   # bytes: kept in the object store of the node that made it
SMALL = 1_000     # bytes: inline (Ray keeps objects under ~100 KB in the owner's memory)
LABEL = "tether.test"


@ray.remote(num_cpus=0.5)
class Peer:
    """A test actor on one node: makes objects there, and pulls objects it is given."""

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def make(self, n: int) -> np.ndarray:
        return np.ones(n, np.uint8)

    def chunk(self, n: int, length: int) -> tuple:
        """One chunk's buffer inputs, rollouts first (``n`` rollouts of ``length`` response tokens)."""
        from actors.rewards.scoring import ScoreResult
        from core.rollout import Rollout

        rollouts = [Rollout(prompt_ids=np.array([1, 2]), response_ids=np.full(length, 3),
                            behaviour_logprobs=np.full(length, -1.0, np.float32), finish_reason="length",
                            policy_version=0, prompt_index=i, sample_index=0) for i in range(n)]
        return rollouts, [np.full(length, -1.5, np.float32)] * n, ScoreResult(np.ones(n, np.float32),
                                                                               np.ones(n, bool))

    def take(self, *args) -> tuple:
        values, moved = pull_args(*args)
        return [v.nbytes if isinstance(v, np.ndarray) else v for v in values], moved

    def relay(self, other, n: int) -> tuple:
        """``other`` makes an object of ``n`` bytes, then pulls it in a Pull sent from here."""
        ref = other.make.remote(n)
        ray.wait([ref], fetch_local=False)
        return ray.get(other.take.remote(Pull(ref)))


def _on(label: str, cls=Peer, **options):
    return cls.options(label_selector={LABEL: label}, **options)


def _two_nodes(ray_nodes, *, on_b: int = 1):
    """Nodes A and B (ids), a Peer on A and ``on_b`` Peers on B."""
    a, b = (ray_nodes.add(num_cpus=1, labels={LABEL: x}) for x in "ab")
    peers = [_on("a").remote()] + [_on("b").remote() for _ in range(on_b)]
    assert ray.get([p.node.remote() for p in peers]) == [a] + [b] * on_b
    return a, *peers


def _made(peer, n: int):
    ref = peer.make.remote(n)
    ray.wait([ref], fetch_local=False)  # made, and left where it is
    return ref


def test_an_object_from_another_node_counts_as_cross_node_and_a_local_one_does_not(ray_nodes):
    _, peer_a, peer_b, peer_b2 = _two_nodes(ray_nodes, on_b=2)
    big = _made(peer_a, BIG)
    [nbytes], moved = ray.get(peer_b.take.remote(Pull(big)))
    assert nbytes == BIG
    assert BIG <= moved.bytes_cross_node < BIG + 4096 and moved.seconds_cross_node > 0  # data + metadata
    assert moved.bytes_local == 0
    [_], again = ray.get(peer_b.take.remote(Pull(big)))  # B holds a copy now
    assert again == Transfer(0, 0.0, moved.bytes_cross_node)

    [nbytes], at_home = ray.get(peer_a.take.remote(Pull(_made(peer_a, BIG))))
    assert nbytes == BIG and at_home.bytes_cross_node == 0 and at_home.seconds_cross_node == 0.0
    assert at_home.bytes_local >= BIG

    # Inline objects come inside the call: from this process (the head node) to B, across nodes,
    # with no seconds of their own; from one actor on B to another, locally.
    [nbytes, plain], inline = ray.get(peer_b.take.remote(Pull(_made(peer_a, SMALL)), "value"))
    assert (nbytes, plain) == (SMALL, "value")
    assert SMALL < inline.bytes_cross_node < 100_000 and inline.seconds_cross_node == 0.0
    assert inline.bytes_local == 0
    [nbytes], same_node = ray.get(peer_b.relay.remote(peer_b2, SMALL))
    assert nbytes == SMALL and same_node.bytes_cross_node == 0 and SMALL < same_node.bytes_local < 100_000
    [_], other_node = ray.get(peer_a.relay.remote(peer_b2, SMALL))
    assert SMALL < other_node.bytes_cross_node < 100_000


def _buffer_on(label: str):
    from actors.buffer import RolloutBuffer
    return _on(label, ray.remote(RolloutBuffer), num_cpus=0.5, max_concurrency=4).remote(capacity=64)


def test_the_buffer_reports_what_its_put_pulled_from_another_node(ray_nodes):
    from core.annotate import RewardShaping

    _, peer_a, _ = _two_nodes(ray_nodes)
    buffer = _buffer_on("b")
    inputs = peer_a.chunk.options(num_returns=3).remote(8, 4096)  # rollouts ~300 KB: in A's store
    ray.wait(inputs, num_returns=3, fetch_local=False)
    report = ray.get(buffer.put_chunk.remote(0, *map(Pull, inputs), RewardShaping(beta=0.1)))
    assert report.stored == 8 and not report.duplicate
    assert report.transfer.bytes_cross_node > 8 * 4096 * (8 + 4) and report.transfer.seconds_cross_node > 0
    assert report.transfer.bytes_local == 0  # even the small ScoreResult came from this (head) node
    again = ray.get(buffer.put_chunk.remote(0, *map(Pull, inputs), RewardShaping(beta=0.1)))
    assert again.duplicate and again.transfer == Transfer()  # a duplicate pulls nothing


def test_a_put_whose_input_was_lost_with_its_node_fails_as_lost_and_stores_nothing(ray_nodes):
    from core.annotate import RewardShaping

    a, peer_a, peer_b = _two_nodes(ray_nodes)
    buffer = _buffer_on("b")
    inputs = peer_a.chunk.options(num_returns=3).remote(8, 4096)
    ray.wait(inputs, num_returns=3, fetch_local=False)
    ray_nodes.kill(a)
    with pytest.raises(RayTaskError) as lost:
        ray.get(buffer.put_chunk.remote(0, *map(Pull, inputs), RewardShaping(beta=0.1)), timeout=120)
    assert isinstance(lost.value.cause, ObjectLostError)  # what the producer's recovery looks for
    stats = ray.get(buffer.stats.remote())
    assert stats["depth"] == 0 and stats["chunks_stored"] == 0
    # The chunk id is free again: its redispatched copy is stored, not refused as a duplicate.
    again = peer_b.chunk.options(num_returns=3).remote(8, 16)
    report = ray.get(buffer.put_chunk.remote(0, *map(Pull, again), RewardShaping(beta=0.1)))
    assert report.stored == 8 and not report.duplicate

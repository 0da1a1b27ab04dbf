import collections
import os
import sys
import threading
import time

import numpy as np
import pytest
import ray

from actors.buffer import BufferClosed, RolloutBuffer
from core.rollout import ScoredRollout

# Ray workers cannot import this test module; ship its helpers (Producer, item) by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def item(version=0, index=0, producer=0):
    z = np.zeros(2, np.float32)
    return ScoredRollout(prompt_ids=np.array([1]), response_ids=np.array([2, 3]), behaviour_logprobs=z,
                         finish_reason="stop", policy_version=version, prompt_index=index,
                         sample_index=producer, reference_logprobs=z, kl=z, rewards=z)


def ids(items):
    return [(x.sample_index, x.prompt_index) for x in items]


def until(stats, **expected):
    """Wait until the buffer's stats() show ``expected`` (e.g. waiting_puts=2): a waiter is
    counted under the buffer's lock just before it waits, so this is its real readiness."""
    deadline = time.monotonic() + 30
    while {k: stats()[k] for k in expected} != expected:
        assert time.monotonic() < deadline, f"buffer never reached {expected}: {stats()}"
        time.sleep(0.001)


@pytest.fixture(scope="module")
def cluster():
    import rays
    rays.shared()


RemoteBuffer = ray.remote(max_concurrency=8)(RolloutBuffer)


def new_buffer(capacity):
    return RemoteBuffer.remote(capacity=capacity)


# --------------------------------------------------------------------------- plain object


@pytest.mark.unit
def test_validation():
    for bad in (0, -1, 2.0, True, None):
        with pytest.raises(ValueError, match="capacity"):
            RolloutBuffer(capacity=bad)
    buf = RolloutBuffer(capacity=3)
    with pytest.raises(ValueError, match="exceeds capacity 3"):
        buf.get(4)
    with pytest.raises(ValueError, match="n must be"):
        buf.get(0)
    with pytest.raises(ValueError, match="can never fit"):
        buf.put([item()] * 4)
    with pytest.raises(TypeError, match="ScoredRollout"):
        buf.put(["not a rollout"])
    assert buf.put([]) == 0
    assert buf.health() == {"role": "buffer", "ok": True, "pid": os.getpid(), "depth": 0, "capacity": 3}


@pytest.mark.unit
def test_close_wakes_waiters_and_waiting_puts_are_served_in_order():
    buf = RolloutBuffer(capacity=3)
    buf.put([item(index=0), item(index=1)])
    results = {}

    def put(name, items):
        try:
            results[name] = buf.put(items, timeout=5)
        except Exception as e:  # noqa: BLE001
            results[name] = e

    big = threading.Thread(target=put, args=("big", [item(index=10), item(index=11), item(index=12)]))
    big.start()
    until(buf.stats, waiting_puts=1)
    small = threading.Thread(target=put, args=("small", [item(index=20)]))
    small.start()
    until(buf.stats, waiting_puts=2)
    # Room for the small put exists, but it queued behind the big one: no starvation.
    assert buf.stats()["depth"] == 2
    assert ids(buf.get(2)) == [(0, 0), (0, 1)]
    big.join(2)
    assert results["big"] == 3
    assert ids(buf.get(3)) == [(0, 10), (0, 11), (0, 12)]
    small.join(2)
    assert results["small"] == 1

    getter = threading.Thread(target=lambda: results.setdefault("get", _catch(lambda: buf.get(3))))
    getter.start()
    until(buf.stats, waiting_gets=1)
    buf.close()
    getter.join(2)
    assert isinstance(results["get"], BufferClosed)
    with pytest.raises(BufferClosed):
        buf.put([item()])
    assert ids(buf.get(1)) == [(0, 20)]  # what was buffered stays gettable
    assert not buf.health()["ok"]


def _catch(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        return e


# --------------------------------------------------------------------------- as a Ray actor


@pytest.mark.integration
def test_fifo(cluster):
    buf = new_buffer(10)
    assert ray.get(buf.put.remote([item(index=i) for i in range(3)])) == 3
    ray.get(buf.put.remote([item(index=i) for i in range(3, 6)]))
    assert [x.prompt_index for x in ray.get(buf.get.remote(4))] == [0, 1, 2, 3]
    ray.get(buf.put.remote([item(index=6)]))
    assert [x.prompt_index for x in ray.get(buf.get.remote(3))] == [4, 5, 6]
    stats = ray.get(buf.stats.remote())
    assert (stats["put_total"], stats["got_total"], stats["depth"]) == (7, 7, 0)


@pytest.mark.integration
def test_version_filter_drops_and_counts_stale(cluster):
    buf = new_buffer(10)
    versions = [0, 2, 1, 0, 3, 2, 1]  # interleaved, as from several generators
    ray.get(buf.put.remote([item(version=v, index=i) for i, v in enumerate(versions)]))
    got = ray.get(buf.get.remote(3, min_version=2))
    assert [(x.prompt_index, x.policy_version) for x in got] == [(1, 2), (4, 3), (5, 2)]
    stats = ray.get(buf.stats.remote())
    assert stats["dropped_stale"] == 4 and stats["depth"] == 0
    # staleness: newest version put (3) minus each gotten version -> (1 + 0 + 1) / 3
    assert stats["mean_staleness"] == pytest.approx(2 / 3) and stats["max_staleness"] == 1
    ray.get(buf.put.remote([item(version=3)]))
    ray.get(buf.get.remote(1, current_version=5))
    assert ray.get(buf.stats.remote())["max_staleness"] == 2


@pytest.mark.integration
def test_put_blocks_when_full_until_a_get_frees_room(cluster):
    buf = new_buffer(2)
    ray.get(buf.put.remote([item(index=0), item(index=1)]))
    blocked = buf.put.remote([item(index=2)], timeout=30)
    until(lambda: ray.get(buf.stats.remote()), waiting_puts=1)
    ready, _ = ray.wait([blocked], timeout=0)
    assert not ready, "put on a full buffer returned instead of blocking"
    assert [x.prompt_index for x in ray.get(buf.get.remote(1))] == [0]
    assert ray.get(blocked, timeout=10) == 1
    assert [x.prompt_index for x in ray.get(buf.get.remote(2))] == [1, 2]


@pytest.mark.integration
def test_put_times_out_when_nobody_gets(cluster):
    buf = new_buffer(2)
    ray.get(buf.put.remote([item(index=0), item(index=1)]))
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="put of 1 rollouts waited 0.5s.*nothing was put"):
        ray.get(buf.put.remote([item(index=2)], timeout=0.5))
    assert time.monotonic() - start >= 0.5
    assert ray.get(buf.stats.remote())["depth"] == 2


@pytest.mark.integration
def test_get_timeout(cluster):
    buf = new_buffer(4)
    ray.get(buf.put.remote([item()]))
    with pytest.raises(TimeoutError, match=r"buffer: waited 0.3s for 2 rollouts, have 1"):
        ray.get(buf.get.remote(2, timeout=0.3))
    with pytest.raises(TimeoutError, match="have 0"):  # stale items do not count
        ray.get(buf.get.remote(1, min_version=1, timeout=0.1))


@ray.remote
class Producer:
    def __init__(self, buffer, producer_id):
        self.buffer, self.producer_id = buffer, producer_id

    def run(self, n_items, batch):
        for start in range(0, n_items, batch):
            chunk = [item(version=0, index=i, producer=self.producer_id)
                     for i in range(start, min(start + batch, n_items))]
            ray.get(self.buffer.put.remote(chunk, timeout=60))
        return n_items


@pytest.mark.integration
def test_concurrent_producers_each_item_exactly_once(cluster):
    buf = new_buffer(8)  # smaller than the total, so producers hit backpressure
    producers = [Producer.remote(buf, p) for p in range(3)]
    runs = [p.run.remote(20, 4) for p in producers]
    got = []
    while len(got) < 60:
        got += ray.get(buf.get.remote(5, timeout=30))
    assert ray.get(runs) == [20, 20, 20]
    keys = ids(got)
    assert len(keys) == len(set(keys)) == 60
    assert set(keys) == {(p, i) for p in range(3) for i in range(20)}
    for p in range(3):  # FIFO also holds per producer
        assert [i for q, i in keys if q == p] == list(range(20))
    stats = ray.get(buf.stats.remote())
    assert (stats["put_total"], stats["got_total"], stats["depth"], stats["dropped_stale"]) == (60, 60, 0, 0)


# ------------------------------------------------------------ by reference: put_chunk / take

def _rollouts(n, version=0):
    from core.rollout import Rollout
    return [Rollout(prompt_ids=np.array([1, 2]), response_ids=np.array([3, 4, 5]),
                    behaviour_logprobs=np.array([-1.0, -1.0, -1.0], np.float32), finish_reason="stop",
                    policy_version=version, prompt_index=i, sample_index=0) for i in range(n)]


def _scores(values, valid):
    from actors.rewards.scoring import ScoreResult
    return ScoreResult(np.array(values, np.float32), np.array(valid, bool), ["reward said no"])


@pytest.mark.unit
def test_put_chunk_annotates_and_stores_each_chunk_once():
    from core.annotate import RewardShaping

    buf = RolloutBuffer(capacity=16)
    ref_lp = [np.array([-1.5, -1.0, -0.5], np.float32)] * 3
    shaping = RewardShaping(beta=0.1)
    report = buf.put_chunk(7, _rollouts(3), ref_lp, _scores([1.0, np.nan, 2.0], [True, False, True]), shaping)
    assert (report.stored, report.invalid_scores, report.duplicate) == (2, 1, False)
    assert report.errors == ("reward said no",)
    again = buf.put_chunk(7, _rollouts(3), ref_lp, _scores([1.0, 1.0, 2.0], [True] * 3), shaping)
    assert again.duplicate and again.stored == 0
    assert buf.stats()["depth"] == 2 and buf.stats()["chunks_stored"] == 1
    got = buf.get(2)
    # k1 KL = behaviour - reference; rewards = -beta * kl, plus the score on the last token.
    np.testing.assert_allclose(got[0].kl, [0.5, 0.0, -0.5])
    np.testing.assert_allclose(got[0].rewards, [-0.05, 0.0, 0.05 + 1.0], rtol=1e-6)
    assert [r.prompt_index for r in got] == [0, 2] and got[1].score == 2.0


@pytest.mark.unit
def test_take_returns_whole_shards_and_a_summary():
    buf = RolloutBuffer(capacity=16)
    items = [item(version=v, index=i) for i, v in enumerate([3, 3, 2, 3, 3])]
    buf.put(items)
    *shards, summary = buf.take(5, world_size=2, current_version=3)
    assert [[r.prompt_index for r in s] for s in shards] == [[0, 1], [2, 3, 4]]  # none left out
    assert summary.staleness.tolist() == [0, 0, 1, 0, 0]
    assert summary.response_lengths.tolist() == [2] * 5 and len(summary.samples) == 4


@pytest.mark.integration
def test_take_by_reference_through_ray(cluster):
    """Each shard is its own object: a rank can be handed one without the others."""
    buf = new_buffer(16)
    ray.get(buf.put.remote([item(index=i) for i in range(4)]))
    *shards, summary = buf.take.options(num_returns=3).remote(4, world_size=2)
    assert all(isinstance(s, ray.ObjectRef) for s in shards)
    assert [r.prompt_index for r in ray.get(shards[1])] == [2, 3]
    assert ray.get(summary).scores.size == 4


# ------------------------------------------------------------ a prompt's samples stay together

def _put_prompts(buf, chunk_id, prompts, *, n=4, invalid=(), old=()):
    """put_chunk of ``n`` samples per prompt; (prompt, sample) pairs in ``invalid`` get a NaN
    score (left out), those in ``old`` were sampled one version before the rest."""
    from actors.rewards.scoring import ScoreResult
    from core.annotate import RewardShaping
    from core.rollout import Rollout

    rollouts = [Rollout(prompt_ids=np.array([1, 2]), response_ids=np.array([3, 4, 5]),
                        behaviour_logprobs=np.full(3, -1.0, np.float32), finish_reason="stop",
                        policy_version=0 if (p, s) in old else 1, prompt_index=p, sample_index=s)
                for p in prompts for s in range(n)]
    valid = np.array([(r.prompt_index, r.sample_index) not in invalid for r in rollouts])
    scores = ScoreResult(np.where(valid, 1.0, np.nan).astype(np.float32), valid)
    return buf.put_chunk(chunk_id, rollouts, [np.full(3, -1.5, np.float32)] * len(rollouts), scores,
                         RewardShaping(beta=0.1))


@pytest.mark.unit
def test_take_never_splits_a_prompts_samples():
    """The take's size is a rollout count, but a prompt's samples leave the buffer together:
    the take goes on to the end of the prompt its last rollout belongs to."""
    buf = RolloutBuffer(capacity=32)
    _put_prompts(buf, 0, [10, 11], invalid={(10, 2)})  # prompt 10 keeps 3 of its 4 samples
    _put_prompts(buf, 1, [12, 13])
    *_, summary = buf.take(8, world_size=1)  # rollout 8 is prompt 12's first
    assert collections.Counter(summary.consumed) == {(0, 10): 3, (0, 11): 4, (1, 12): 4}
    assert [(x.chunk_id, x.prompt_index) for x in buf.get(4)] == [(1, 13)] * 4


@pytest.mark.unit
def test_a_stale_sample_discards_its_whole_prompt():
    buf = RolloutBuffer(capacity=32)
    _put_prompts(buf, 0, [10, 11], old={(10, 1)})  # one of prompt 10's samples is a version behind
    *_, summary = buf.take(4, world_size=1, min_version=1, current_version=1)
    assert collections.Counter(summary.consumed) == {(0, 10): 4, (0, 11): 4}  # 10 dropped, 11 trained
    assert summary.dropped_stale == 4 and summary.scores.size == 4 and buf.stats()["depth"] == 0


@pytest.mark.unit
def test_dynamic_sampling_leaves_out_prompts_whose_samples_all_scored_alike():
    """drop_flat_groups: prompt 0 (1, 1, 1) is left out, prompt 1 (1, 0, 1) is kept, prompt 2
    keeps a single valid sample (nothing to compare it with) and stays."""
    from actors.rewards.scoring import ScoreResult
    from core.annotate import RewardShaping
    from core.rollout import Rollout

    values = {(0, 0): 1.0, (0, 1): 1.0, (0, 2): 1.0, (1, 0): 1.0, (1, 1): 0.0, (1, 2): 1.0,
              (2, 0): 1.0, (2, 1): np.nan, (2, 2): np.nan}
    rollouts = [Rollout(prompt_ids=np.array([1, 2]), response_ids=np.array([3, 4]),
                        behaviour_logprobs=np.full(2, -1.0, np.float32), finish_reason="stop",
                        policy_version=0, prompt_index=p, sample_index=s) for p, s in values]
    scores = np.array(list(values.values()), np.float32)
    result = ScoreResult(scores, np.isfinite(scores))
    for drop, kept in ((True, [1, 2]), (False, [0, 1, 2])):
        buf = RolloutBuffer(capacity=16)
        report = buf.put_chunk(3, rollouts, [np.full(2, -1.0, np.float32)] * 9, result, RewardShaping(beta=0.1),
                               drop_flat_groups=drop)
        assert [p for p, _ in report.held] == kept
        assert (report.filtered_prompts, report.filtered_rollouts) == ((1, 3) if drop else (0, 0))
        assert report.stored == buf.stats()["depth"] == 3 * len(kept) - 2  # prompt 2: one valid sample


@pytest.mark.unit
def test_drop_surplus_takes_the_first_whole_groups_in_prompt_order_and_leaves_the_rest_out():
    """A refilled step (dynamic sampling) trains on one batch: whatever order the chunks came
    in, the first whole groups by (chunk, prompt) make it, and every other rollout held
    leaves the buffer as consumed, untrained."""
    buf = RolloutBuffer(capacity=64)
    _put_prompts(buf, 2, [20, 21])  # a refill's chunk lands first
    _put_prompts(buf, 0, [5], invalid={(5, 3)})  # 3 valid samples
    _put_prompts(buf, 1, [7, 8])
    *shards, summary = buf.take(12, world_size=1, min_version=1, current_version=1, drop_surplus=True)
    groups = [(x.chunk_id, x.prompt_index) for x in shards[0]]
    assert groups == [(0, 5)] * 3 + [(1, 7)] * 4 + [(1, 8)] * 4 + [(2, 20)] * 4  # 12 reached inside (2, 20)
    assert summary.surplus == 4 and buf.stats()["depth"] == 0
    assert collections.Counter(summary.consumed) == {(0, 5): 3, (1, 7): 4, (1, 8): 4, (2, 20): 4, (2, 21): 4}
    # without it, the take is the oldest in arrival order and the rest stays for later
    buf = RolloutBuffer(capacity=64)
    _put_prompts(buf, 2, [20, 21])
    _put_prompts(buf, 1, [7, 8])
    *shards, summary = buf.take(8, world_size=1, min_version=1, current_version=1)
    assert {x.chunk_id for x in shards[0]} == {2} and summary.surplus == 0 and buf.stats()["depth"] == 8

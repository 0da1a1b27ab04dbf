"""The step's transfer/* metrics: the producer's hops merged, the learner ranks' summed."""
import pytest

from cluster.runtime.observe.produced import Produced, transfer_metrics
from core.infra.transfer import Transfer

pytestmark = pytest.mark.unit


def test_produced_merges_transfers_and_the_step_metrics_sum_the_hops():
    a = Produced(to_scorers=Transfer(10, 1.0, 1), to_buffer=Transfer(20, 2.0, 2))
    b = Produced(to_scorers=Transfer(5, 0.5, 0))
    merged = a.merge(b)
    assert merged.to_scorers == Transfer(15, 1.5, 1) and merged.to_buffer == Transfer(20, 2.0, 2)
    m = transfer_metrics(merged, Transfer(40, 4.0, 0))
    assert m == {"transfer/cross_node_bytes": 75, "transfer/cross_node_seconds": 7.5,
                 "transfer/to_scorers_bytes": 15, "transfer/to_buffer_bytes": 20, "transfer/to_learner_bytes": 40}
    assert set(transfer_metrics(Produced(), Transfer()).values()) == {0}  # one node: every figure 0


def test_learner_ranks_transfers_are_summed_not_averaged():
    from learner.objectives.stats import merge_rank_metrics

    ranks = [{"ppo/clip_frac": 0.1, "perf/learner_seconds": 1.0, **Transfer(100, 0.5, 0).as_metrics("transfer/x")},
             {"ppo/clip_frac": 0.3, "perf/learner_seconds": 2.0, **Transfer(300, 1.5, 8).as_metrics("transfer/x")}]
    merged = merge_rank_metrics(ranks)
    assert merged["ppo/clip_frac"] == pytest.approx(0.2) and merged["perf/learner_seconds"] == 2.0
    assert Transfer.pop_metrics(merged, "transfer/x") == Transfer(400, 2.0, 8)

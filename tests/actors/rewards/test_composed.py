"""reward.sources: the combination math (sum, gdpo, a monitor, an invalid source) by hand, and a
replica scoring its sources concurrently and combining them."""
import math

import numpy as np
import pytest
from reward_configs import reward_config

from actors.rewards.combine import COMBINERS, EPS, combine, group_normalised
from actors.rewards.config import RewardSourceConfig

# Two prompt groups of two samples; source 1 is flat in group 1.
GROUPS = [0, 0, 1, 1]
C1 = [1.0, 0.0, 1.0, 1.0]
C2 = [0.0, 2.0, 3.0, 1.0]
ALL = np.ones((2, 4), bool)


@pytest.mark.unit
def test_sum_is_the_weighted_sum_and_a_monitor_adds_nothing():
    scores, valid = combine([C1, C2, [100.0, 200.0, 300.0, 400.0]], np.ones((3, 4), bool), [1.0, 0.5, 0.0],
                            GROUPS, "sum")
    assert valid.all()
    assert scores.tolist() == [1.0, 1.0, 2.5, 1.5]  # 1 + 0.5 x 0, 0 + 0.5 x 2, 1 + 0.5 x 3, 1 + 0.5 x 1


@pytest.mark.unit
def test_gdpo_normalises_each_source_within_its_group_before_the_weighted_sum():
    scores, valid = combine([C1, C2], ALL, [1.0, 0.5], GROUPS, "gdpo")
    # group 0: source 1 (1, 0) mean 0.5, std (n-1) sqrt(0.5); source 2 (0, 2) mean 1, std sqrt(2)
    # group 1: source 1 flat -> 0; source 2 (3, 1) mean 2, std sqrt(2)
    a, b = 0.5 / (math.sqrt(0.5) + EPS), 1.0 / (math.sqrt(2) + EPS)
    assert scores.tolist() == pytest.approx([a - 0.5 * b, -a + 0.5 * b, 0.5 * b, -0.5 * b], rel=1e-6)
    summed, _ = combine([C1, C2], ALL, [1.0, 0.5], GROUPS, "sum")
    assert not np.allclose(scores, summed)  # a different rule, not the sum under another name


@pytest.mark.unit
def test_gdpo_keeps_mixes_apart_that_normalising_the_sum_collapses():
    # (1, 0) and (0, 1) against (0, 0): the summed scores tie; per-source normalisation does not
    # when the sources' spreads differ (the paper's collapse example, weighted 1 and 1).
    groups = [0, 0, 0, 0]
    c1, c2 = [1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]
    summed, _ = combine([c1, c2], np.ones((2, 4), bool), [1.0, 1.0], groups, "sum")
    gdpo, _ = combine([c1, c2], np.ones((2, 4), bool), [1.0, 1.0], groups, "gdpo")
    assert summed[0] == summed[1]
    assert gdpo[0] > gdpo[1]  # the rarer success (source 1: one of four) counts for more


@pytest.mark.unit
def test_an_invalid_source_makes_its_pair_invalid_and_leaves_the_group_statistics():
    valid = ALL.copy()
    valid[0, 1] = False  # source 1 gave pair 1 no score
    for how in COMBINERS:
        scores, pair_valid = combine([C1, C2], valid, [1.0, 0.5], GROUPS, how)
        assert pair_valid.tolist() == [False if i == 1 else True for i in range(4)] and math.isnan(scores[1])
    scores, _ = combine([C1, C2], valid, [1.0, 0.5], GROUPS, "gdpo")
    assert scores[0] == 0.0  # alone in its group once pair 1 is out: nothing to compare with
    # a monitor's NaN voids the pair too (it is scored, and its score must be a number)
    _, pair_valid = combine([C1, [1.0, math.nan, 1.0, 1.0]], ALL, [1.0, 0.0], GROUPS, "sum")
    assert pair_valid.tolist() == [True, False, True, True]


@pytest.mark.unit
def test_group_normalised_by_hand():
    out = group_normalised([2.0, 4.0, 6.0, 5.0], np.ones(4, bool), np.array([0, 0, 0, 1]))
    # group 0: mean 4, std (n-1) 2; group 1: one pair -> 0
    assert out.tolist() == pytest.approx([-2 / (2 + EPS), 0.0, 2 / (2 + EPS), 0.0])


@pytest.mark.unit
def test_combine_refuses_an_unknown_rule_naming_the_choices():
    with pytest.raises(ValueError, match="unknown 'mean'; use one of sum, gdpo"):
        combine([C1], np.ones((1, 4), bool), [1.0], GROUPS, "mean")


def _sources(*items):
    return reward_config(sources=tuple(RewardSourceConfig(**item) for item in items))


def _ids(n, length=3):
    return [np.arange(1, 1 + length) + i for i in range(n)]


@pytest.mark.integration
def test_a_replica_scores_its_sources_concurrently_and_combines_them(policy_path):
    from actors.reward import Reward

    # meets_a and meets_b each wait for the other: scored one after another, both would time out
    rw = Reward(config=_sources({"name": "a", "function": "composed_rewards:meets_a", "timeout_s": 20},
                                {"name": "b", "weight": 0.5, "function": "composed_rewards:meets_b", "timeout_s": 20},
                                {"name": "len", "weight": 0.0, "function": "composed_rewards:lengths"}),
                tokenizer=policy_path)
    res = rw.score(_ids(3), _ids(3, 5))
    assert res.valid.all() and not res.errors, res.errors
    assert res.scores.tolist() == [2.0, 2.0, 2.0]  # 1 + 0.5 x 2; the monitor adds nothing
    assert sorted(res.components) == ["a", "b", "len"] and res.components["b"].tolist() == [2.0] * 3
    assert (res.components["len"] > 0).all()
    assert set(rw.health()["sources"]) == {"a", "b", "len"}
    rw.close()


@pytest.mark.integration
def test_a_sources_invalid_score_voids_the_pair_with_its_name_in_the_message(policy_path):
    from actors.reward import Reward

    rw = Reward(config=_sources({"name": "one", "function": "composed_rewards:ones"},
                                {"name": "half", "weight": 0.0, "function": "composed_rewards:nan_at_first"}),
                tokenizer=policy_path)
    res = rw.score(_ids(3), _ids(3))
    assert res.valid.tolist() == [False, True, True] and res.scores[1:].tolist() == [1.0, 1.0]
    assert len(res.errors) == 1 and res.errors[0].startswith("source half: reward function composed_rewards:")
    assert rw.stats()["invalid_items"] == 1

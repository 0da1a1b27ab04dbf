"""Credit per turn with the group estimators (env.reward_placement=turn): episodes annotated as the
reference pool does, collated and handed to the estimators as a learner rank does
(learner/objectives/advantage_inputs.py), so what is checked is what a run trains on."""
from dataclasses import replace

import numpy as np
import pytest
import torch

from core.annotate import annotate
from core.choices import gamma_error
from core.estimators import EstimatorOptions, estimator
from core.rollout import Rollout
from core.turn_credit import turn_index, turn_units
from learner.batch import collate
from learner.collectives import Collectives
from learner.objectives.advantage_inputs import advantage_inputs

pytestmark = pytest.mark.unit

GROUP_ESTIMATORS = ["grpo", "rloo", "reinforce_pp_baseline"]
# Two policy turns (columns 0-1 and 4-6) around a two-token observation; one-turn rows stop at 2.
TWO_TURNS = np.array([1, 1, 0, 0, 1, 1, 1], bool)


def episode(rewards, prompt=0, sample=0):
    """An episode of len(rewards) turns (1 or 2) with each turn's reward on its last token."""
    mask = TWO_TURNS if len(rewards) == 2 else TWO_TURNS[:2]
    placed = np.zeros(mask.size, np.float32)
    ends = [1, 6][:len(rewards)]
    placed[ends] = rewards
    return Rollout(prompt_ids=[1, 2], response_ids=np.arange(5, 5 + mask.size),
                   behaviour_logprobs=np.where(mask, -1.0, 0.0), finish_reason="stop", policy_version=0,
                   prompt_index=prompt, sample_index=sample, action_mask=mask, turn_rewards=placed)


def advantages(name, groups, *, by_turn=True, beta=0.0, gamma=1.0):
    """[B, T] the advantages of ``groups`` (lists of per-turn reward lists, a group per prompt)."""
    rollouts = [episode(r, p, k) for p, group in enumerate(groups) for k, r in enumerate(group)]
    if not by_turn:
        rollouts = [Rollout(**{**r.__dict__, "turn_rewards": None, "env_score": float(r.turn_rewards.sum())})
                    for r in rollouts]
    refs = [np.where(r.action_mask, -1.5, 0.0).astype(np.float32) for r in rollouts]
    scored = annotate(rollouts, refs, np.array([r.turn_rewards.sum() if by_turn else r.env_score
                                                for r in rollouts]), beta=beta)
    for r in scored:
        r.chunk_id = 0
    batch = collate(scored, pad_id=0)
    x = advantage_inputs(batch, scored, comm=Collectives(world_size=1, device=torch.device("cpu")), row_offset=0,
                         device=torch.device("cpu"), with_population=True)
    adv, _ = estimator(name).fn(x, EstimatorOptions(gamma=gamma))
    return adv, batch.response_mask


def turns_of(adv, mask):
    """Each row's advantage per turn, checking that every token of a turn holds the same value."""
    out = []
    for row, m in zip(adv, mask):
        index = turn_index(m[None])[0]
        per_turn = []
        for k in range(int(index.max()) + 1):
            values = row[index == k]
            assert torch.allclose(values, values[0].expand_as(values), atol=1e-6), values
            per_turn.append(round(float(values[0]), 4))
        out.append(per_turn)
    return out


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_a_group_that_earned_the_same_rewards_turn_by_turn_learns_nothing(name):
    """Every sample earned [1, 0]: nothing to learn, 0 on every token, as with the score on the last
    token. Before turn credit, turn 2 was charged the turn-1 reward it did not earn (-1)."""
    adv, mask = advantages(name, [[[1, 0]] * 4, [[0.5, 0.25]] * 3])
    assert bool((adv == 0).all()), turns_of(adv, mask)
    whole, _ = advantages(name, [[[1, 0]] * 4, [[0.5, 0.25]] * 3], by_turn=False)
    assert bool((whole == 0).all())


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_a_group_whose_returns_differ_only_at_turn_two_moves_only_turn_two(name):
    """[1, 0] against [0, 1]: both returns from turn 1 are 1 (turn 1 earned as much either way), the
    returns from turn 2 are 0 and 1. Scored as a whole the two are equal and get 0 everywhere."""
    adv, mask = advantages(name, [[[1, 0], [0, 1], [1, 0], [0, 1]]])
    credit = turns_of(adv, mask)
    assert [t[0] for t in credit] == [0, 0, 0, 0]
    assert credit[0][1] < 0 < credit[1][1] and credit[0][1] == -credit[1][1] == credit[2][1]
    whole, _ = advantages(name, [[[1, 0], [0, 1], [1, 0], [0, 1]]], by_turn=False)
    assert bool((whole == 0).all())


def test_grpo_credits_each_turn_by_its_return_against_the_same_turn_of_its_group():
    """By hand: returns from turn 1 [2, 1, 0.5], from turn 2 [1, 1] (the one-turn sample has no
    turn 2, so it does not count there)."""
    adv, mask = advantages("grpo", [[[1, 1], [0, 1], [0.5]]])
    first = torch.tensor([2.0, 1.0, 0.5], dtype=torch.float64)
    want = ((first - first.mean()) / (first.std() + 1e-6)).tolist()
    credit = turns_of(adv, mask)
    assert [t[0] for t in credit] == pytest.approx(want, abs=1e-4)
    assert credit[0][1] == credit[1][1] == 0 and len(credit[2]) == 1


def test_rloo_turn_two_is_baselined_by_the_other_samples_turn_two():
    adv, mask = advantages("rloo", [[[0, 1], [0, 0], [0, 0.5]]])
    credit = turns_of(adv, mask)
    # returns from either turn: [1, 0, 0.5]; each less the mean of the other two
    assert credit == [[0.75, 0.75], [-0.75, -0.75], [0.0, 0.0]]


@pytest.mark.parametrize("name", ["grpo", "rloo"])  # reinforce_pp_baseline's whitening all-reduces besides
def test_a_ranks_share_with_the_batchs_turns_gets_the_whole_batchs_advantages(name):
    """Two ranks' shards, each with every rank's turns as the population: the advantages of the batch
    in one piece."""
    groups = [[[1, 0], [0, 1], [0.5]], [[0, 0], [1, 1]]]
    whole, _ = advantages(name, groups)
    rollouts = [episode(r, p, k) for p, group in enumerate(groups) for k, r in enumerate(group)]
    refs = [np.where(r.action_mask, -1.5, 0.0).astype(np.float32) for r in rollouts]
    scored = annotate(rollouts, refs, np.array([r.turn_rewards.sum() for r in rollouts]), beta=0.0)
    for r in scored:
        r.chunk_id = 0
    everyone = advantage_inputs(collate(scored, 0), scored, comm=Collectives(world_size=1, device=torch.device("cpu")),
                                row_offset=0, device=torch.device("cpu"), with_population=True).turn_population
    for lo, hi in ((0, 2), (2, 5)):
        share = scored[lo:hi]
        x = advantage_inputs(collate(share, 0), share, comm=Collectives(world_size=1, device=torch.device("cpu")),
                             row_offset=lo, device=torch.device("cpu"), with_population=True)
        adv, _ = estimator(name).fn(replace(x, turn_population=everyone), EstimatorOptions())
        assert torch.allclose(adv, whole[lo:hi, :adv.shape[1]], atol=1e-6)


def test_the_kl_penalty_still_sums_to_the_end_of_the_row():
    """With beta > 0 each token also gets the KL penalty's returns-to-go (the environment's tokens
    carry none): turn credit 0 here, so what is left is -beta x kl summed to the row's end."""
    adv, mask = advantages("rloo", [[[1, 0]] * 2], beta=0.1)
    kl_left = torch.tensor([-0.1 * 0.5 * n for n in (5, 4, 0, 0, 3, 2, 1)])  # k1 = -1 - (-1.5) per policy token
    assert torch.allclose(adv[0], kl_left * mask[0], atol=1e-6)


def test_turn_units_are_the_runs_of_policy_tokens():
    mask = torch.tensor([[1, 1, 0, 1, 0, 1], [1, 1, 1, 0, 0, 0]], dtype=torch.float32)
    placed = torch.tensor([[0, 2.0, 0, 3.0, 0, 4.0], [0, 0, 1.0, 0, 0, 0]])
    units = turn_units(placed, mask)
    assert units.row.tolist() == [0, 0, 0, 1] and units.turn.tolist() == [0, 1, 2, 0]
    assert units.first.tolist() == [0, 3, 5, 0] and units.last.tolist() == [1, 3, 5, 2]
    assert units.returns.tolist() == [9.0, 7.0, 4.0, 1.0]
    assert turn_index(mask).tolist() == [[0, 0, -1, 1, -1, 2], [0, 0, 0, -1, -1, -1]]


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_the_outcome_estimators_do_not_discount(name):
    """gamma < 1 leaves them as at gamma 1 (the config refuses it with them; here the function)."""
    at_one, _ = advantages(name, [[[1, 0.5], [0, 0], [0.5, 2]]], by_turn=False)
    discounted, _ = advantages(name, [[[1, 0.5], [0, 0], [0.5, 2]]], by_turn=False, gamma=0.9)
    assert torch.equal(at_one, discounted)
    assert gamma_error(0.99, name) is not None and "ppo.gamma=0.99 has no effect" in gamma_error(0.99, name)
    assert gamma_error(1.0, name) is None and gamma_error(0.99, "gae") is None
    assert gamma_error(0.99, "reinforce_pp") is None

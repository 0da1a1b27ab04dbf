"""The advantage estimators against values worked out by hand: ragged rows with garbage in the
padding, a group of one, a group whose rewards are all equal."""
import math
from dataclasses import replace

import pytest
import torch

from core.choices import ESTIMATOR_HELP, ESTIMATOR_NAMES, ESTIMATOR_TABLE, critic_free_names
from core.estimators import ESTIMATORS, AdvantageInputs, EstimatorOptions, estimator, group_baseline, returns_to_go

pytestmark = pytest.mark.unit

NAN = float("nan")
# rows 0-2: one prompt (group 7), row 3 alone (group 3), rows 4-5: equal rewards (group 9)
GROUP = torch.tensor([7, 7, 7, 3, 9, 9])
SCORES = torch.tensor([1.0, 2.0, 6.0, 5.0, 4.0, 4.0])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.float32)


def inputs(rewards=None, values=None):
    if rewards is None:  # the score on each row's last valid token; NaN in the padding must not leak
        rewards = torch.tensor([[0, 0, 1.0], [2.0, NAN, NAN], [0, 6.0, NAN], [0, 5.0, NAN], [0, 0, 4.0],
                                [4.0, NAN, NAN]])
    return AdvantageInputs(rewards=rewards, scores=SCORES, mask=MASK, group=GROUP, values=values)


def per_row(adv):
    """Each row's advantage, checking it is the same on every valid token and 0 on padding."""
    out = []
    for row, m in zip(adv, MASK):
        valid = row[m != 0]
        assert torch.allclose(valid, valid[0].expand_as(valid)) and bool((row[m == 0] == 0).all())
        out.append(float(valid[0]))
    return out


def test_grpo_normalises_by_the_group_and_dr_grpo_does_not():
    std7 = math.sqrt(((1 - 3) ** 2 + (2 - 3) ** 2 + (6 - 3) ** 2) / 2)  # unbiased: sqrt(7)
    adv, returns = estimator("grpo").fn(inputs(), EstimatorOptions(eps=0.0))
    assert returns is None
    assert per_row(adv) == pytest.approx([-2 / std7, -1 / std7, 3 / std7, 5.0, 0.0, 0.0], abs=1e-6)
    adv, _ = estimator("grpo").fn(inputs(), EstimatorOptions(scale_by_std=False))
    assert per_row(adv) == pytest.approx([-2.0, -1.0, 3.0, 5.0, 0.0, 0.0])


def test_rloo_takes_off_the_mean_of_the_other_samples():
    adv, returns = estimator("rloo").fn(inputs(), EstimatorOptions())
    # row 0: 1 - (2 + 6) / 2; row 1: 2 - (1 + 6) / 2; row 2: 6 - (1 + 2) / 2; alone: 5 - 0
    assert per_row(adv) == pytest.approx([-3.0, -1.5, 4.5, 5.0, 0.0, 0.0]) and returns is None


def test_returns_to_go_sum_each_rows_rewards_to_its_end():
    rewards = torch.tensor([[-0.1, -0.2, 1.0], [2.0, NAN, NAN], [-0.5, 6.0, NAN], [0, 5.0, NAN],
                            [0, 0, 4.0], [4.0, NAN, NAN]])
    got = returns_to_go(rewards, MASK, gamma=0.5)
    want = torch.tensor([[-0.1 - 0.1 + 0.25, -0.2 + 0.5, 1.0], [2.0, 0, 0], [-0.5 + 3.0, 6.0, 0],
                         [2.5, 5.0, 0], [1.0, 2.0, 4.0], [4.0, 0, 0]])
    assert torch.allclose(got, want)


def test_reinforce_pp_whitens_the_returns_over_the_batch():
    rewards = torch.tensor([[-0.1, -0.2, 1.0], [2.0, NAN, NAN], [-0.5, 6.0, NAN], [0, 5.0, NAN],
                            [0, 0, 4.0], [4.0, NAN, NAN]])
    adv, returns = estimator("reinforce_pp").fn(inputs(rewards), EstimatorOptions())
    ret = [0.7, 0.8, 1.0, 2.0, 5.5, 6.0, 5.0, 5.0, 4.0, 4.0, 4.0, 4.0]  # valid tokens, row by row
    mean = sum(ret) / len(ret)
    std = math.sqrt(sum((r - mean) ** 2 for r in ret) / len(ret))  # the batch's population std
    assert adv[MASK != 0].tolist() == pytest.approx([(r - mean) / std for r in ret], abs=1e-5)
    assert bool((adv[MASK == 0] == 0).all()) and returns is None


def test_reinforce_pp_baseline_takes_the_group_mean_off_the_score_first():
    adv, _ = estimator("reinforce_pp_baseline").fn(inputs(), EstimatorOptions())
    # the scores less their group mean (group 7: 3; alone: 0; group 9: 4), held by every token
    ret = [-2, -2, -2, -1, 3, 3, 5, 5, 0, 0, 0, 0]
    mean = sum(ret) / len(ret)
    std = math.sqrt(sum((r - mean) ** 2 for r in ret) / len(ret))
    assert adv[MASK != 0].tolist() == pytest.approx([(r - mean) / std for r in ret], abs=1e-5)


def test_gae_needs_values_and_matches_core_gae():
    from core.advantages import gae
    from core.masked import whiten

    values = torch.linspace(-1, 1, 18).reshape(6, 3)
    adv, returns = estimator("gae").fn(inputs(values=values), EstimatorOptions(gamma=1.0, lam=0.9))
    raw, want_returns = gae(inputs().rewards, values, MASK, 1.0, 0.9)
    # as the learner whitens today: in float64, over the global batch
    assert torch.equal(adv, whiten(raw.double(), MASK).float()) and torch.equal(returns, want_returns)
    unwhitened, _ = estimator("gae").fn(inputs(values=values), EstimatorOptions(lam=0.9, whiten_gae=False))
    assert torch.equal(unwhitened, raw)
    with pytest.raises(ValueError, match="gae: needs the critic's values"):
        estimator("gae").fn(inputs(), EstimatorOptions())


def test_group_baseline_of_a_lone_sample_is_zero():
    mean, n = group_baseline(SCORES, GROUP, leave_one_out=False)
    assert mean.tolist() == [3.0, 3.0, 3.0, 0.0, 4.0, 4.0] and n.tolist() == [3, 3, 3, 1, 2, 2]


def test_registry_names_and_an_unknown_name():
    assert list(ESTIMATORS) == ["gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
    assert [n for n, e in ESTIMATORS.items() if e.needs_critic] == ["gae"]
    # the config's names (no torch there) are the registry's
    assert tuple(ESTIMATORS) == ESTIMATOR_NAMES
    assert [n for n, e in ESTIMATORS.items() if e.uses_groups] == ["grpo", "rloo", "reinforce_pp_baseline"]
    assert critic_free_names() == "grpo | rloo | reinforce_pp | reinforce_pp_baseline"
    # one row each: its function, and its name in the config's help
    assert all(ESTIMATORS[row.name].fn.__name__ == row.function and f"{row.name} (" in ESTIMATOR_HELP
               for row in ESTIMATOR_TABLE)
    with pytest.raises(ValueError, match="advantage estimator 'ppo' is unknown; use one of gae, grpo, rloo"):
        estimator("ppo")


def test_shape_errors_are_one_line():
    bad = AdvantageInputs(rewards=torch.zeros(6, 3), scores=torch.zeros(5), mask=MASK, group=GROUP)
    with pytest.raises(ValueError, match=r"grpo: scores shape \(5,\) does not match mask rows shape \(6,\)"):
        estimator("grpo").fn(bad, EstimatorOptions())


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_a_ranks_share_with_the_batch_as_population_gets_the_whole_batchs_advantages(name):
    """Rows 0, 2, 4 on one rank and 1, 3, 5 on another (groups split across ranks): each share,
    given the whole batch's scores and groups, gets exactly the rows' whole-batch advantages."""
    whole, _ = estimator(name).fn(inputs(), EstimatorOptions())
    for rows in (torch.tensor([0, 2, 4]), torch.tensor([1, 3, 5])):
        share = AdvantageInputs(rewards=inputs().rewards[rows], scores=SCORES[rows], mask=MASK[rows],
                                group=GROUP[rows], population=(SCORES, GROUP))
        got, _ = estimator(name).fn(share, EstimatorOptions())
        assert torch.allclose(got, whole[rows], atol=1e-6)
        alone, _ = estimator(name).fn(replace(share, population=None), EstimatorOptions())
        assert not torch.allclose(alone, whole[rows], atol=1e-3)  # without it the groups are cut


# --- The learning signal: ties, the KL in the reward, the baseline of REINFORCE++-baseline ---

def tied(score, n, dtype=torch.float32, beta=0.0, seed=0):
    """One group of ``n`` samples that all scored ``score`` plus a group of two that did not
    (rows n, n+1), ragged rows of up to 5 tokens, the per-token KL penalty -beta x kl in the
    rewards as core.advantages.per_token_rewards puts it."""
    from core.advantages import per_token_rewards
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 6, (n + 2,), generator=g)
    mask = (torch.arange(5)[None] < lengths[:, None]).float()
    scores = torch.tensor([score] * n + [0.3, 1.7], dtype=torch.float64).to(dtype)
    kl = torch.randn(n + 2, 5, generator=g) * 0.3
    rewards = per_token_rewards(kl, scores.to(torch.float32), mask, beta)
    group = torch.tensor([5] * n + [8, 8])
    return AdvantageInputs(rewards=rewards, scores=scores, mask=mask, group=group), kl


@pytest.mark.parametrize("n", [2, 4, 16, 64])
@pytest.mark.parametrize("score", [0.1, 0.9, 1.1, 3.3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_group_whose_samples_all_scored_alike_gets_exactly_zero(n, score, dtype):
    """Non-dyadic ties: in float32 the group mean of n copies of 3.3 is a rounding step off it
    and the std is not 0, which gave advantages up to 0.32 of one sign."""
    x, _ = tied(score, n, dtype)
    for name, opt in (("grpo", EstimatorOptions()), ("grpo", EstimatorOptions(scale_by_std=False)),
                      ("rloo", EstimatorOptions())):
        adv, _ = estimator(name).fn(x, opt)
        assert bool((adv[:n] == 0).all()), (name, opt.scale_by_std, adv[:n].abs().max())
        assert bool((adv[n:][x.mask[n:] != 0] != 0).all())  # the other group still learns
    mean, _ = group_baseline(x.scores, x.group, leave_one_out=False)
    assert bool((mean[:n] == x.scores[:n].double()).all())


@pytest.mark.parametrize("n", [2, 4, 16])
@pytest.mark.parametrize("scale_by_std", [True, False])
def test_grpo_with_the_kl_in_the_reward_keeps_betas_meaning(n, scale_by_std):
    """The group's std normalises the score only; the per-token KL penalty is added after, as
    its returns-to-go: a tied group's advantage scales with beta (100 : 10 : 1), not 0.77 whatever beta."""
    opt = EstimatorOptions(scale_by_std=scale_by_std)
    size = {}
    for beta in (0.05, 0.005, 0.0005):
        x, kl = tied(3.3, n, beta=beta)
        adv, _ = estimator("grpo").fn(x, opt)
        # The score part is 0 (the group tied). The KL part is exact to half a float32 step of
        # the last token's reward (the score is taken back off it): 1.2e-7 at 3.3.
        want = beta * returns_to_go(-kl, x.mask)
        assert torch.allclose(adv[:n], want[:n], rtol=1e-4, atol=2.5e-7)
        size[beta] = float(adv[:n].abs().sum() / x.mask[:n].sum())
    assert size[0.05] > 1e-3
    assert size[0.05] / size[0.005] == pytest.approx(10, rel=1e-2)
    assert size[0.005] / size[0.0005] == pytest.approx(10, rel=1e-2)


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_group_estimators_shape_the_score_then_add_the_kl_penalty(name):
    """Each group estimator baselines the score within its group (not the score less the KL sum),
    puts it on the last token, adds -beta x kl per token and takes the returns-to-go
    (OpenRLHF's rloo / group_norm / reinforce_baseline); reinforce_pp_baseline then whitens
    over the batch. By hand on a batch whose groups neither tie nor share KL sums."""
    from core.masked import whiten
    beta = 0.05
    x, kl = tied(0.0, 3, beta=beta, seed=4)  # scores 0, 0, 0 | 0.3, 1.7: the first group's changed
    last = x.mask.sum(1).long() - 1
    new = torch.tensor([0.2, 1.4, 2.9, 0.3, 1.7], dtype=torch.float64)
    x = replace(x, scores=new, rewards=x.rewards.index_put((torch.arange(5), last), (new - x.scores).float(),
                                                           accumulate=True))
    s, n = x.scores, 3
    if name == "rloo":
        base = torch.tensor([(s[1] + s[2]) / 2, (s[0] + s[2]) / 2, (s[0] + s[1]) / 2, s[4], s[3]])
        shaped = s - base
    else:
        means = torch.tensor([s[:n].mean()] * n + [s[n:].mean()] * 2)
        shaped = s - means
        if name == "grpo":
            stds = torch.tensor([s[:n].std()] * n + [s[n:].std()] * 2)
            shaped = shaped / (stds + 1e-6)
    dense = torch.zeros_like(x.rewards).index_put((torch.arange(5), last), shaped.float())
    want = returns_to_go(dense - beta * kl, x.mask)
    if name == "reinforce_pp_baseline":
        want = whiten(want.double(), x.mask).float()
    adv, _ = estimator(name).fn(x, EstimatorOptions())
    assert torch.allclose(adv, want, atol=1e-5), (adv, want)


GAPPED = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0], [1, 0, 1, 0, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1],
                       [1, 1, 1, 0, 0, 0, 1, 0], [1, 0, 0, 0, 0, 1, 0, 0], [1, 1, 0, 1, 0, 0, 0, 0]],
                      dtype=torch.float32)  # a multi-turn transcript's environment tokens inside rows


def _squeezed(t, mask):
    """Each row's valid columns moved to its front (the row with its gaps removed), NaN after."""
    out = torch.full_like(t, NAN)
    for i, m in enumerate(mask):
        valid = t[i][m != 0]
        out[i, :valid.numel()] = valid
    return out


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.8)])
def test_masked_columns_inside_a_row_are_skipped_not_ends(name, gamma, lam):
    """A row with gaps (environment tokens between the policy's turns) gets the advantages and
    returns of the same row with those columns removed, and 0 in them: the recursions carry
    across a gap (a turn's last token sees the next turn's value and the final score), gamma and
    lam count valid tokens, and what sits in a gap never leaks in."""
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(6, generator=gen)
    last = GAPPED.shape[1] - 1 - GAPPED.flip(1).argmax(1)
    rewards = (-0.05 * torch.rand(6, 8, generator=gen)).index_put((torch.arange(6), last), scores, accumulate=True)
    rewards = torch.where(GAPPED != 0, rewards, torch.full_like(rewards, NAN))
    values = torch.where(GAPPED != 0, torch.randn(6, 8, generator=gen), torch.full_like(rewards, NAN))
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    opt = EstimatorOptions(gamma=gamma, lam=lam)
    gapped = estimator(name).fn(AdvantageInputs(rewards=rewards, scores=scores, mask=GAPPED, group=group,
                                                values=values), opt)
    squeezed_mask = _squeezed(GAPPED, GAPPED).nan_to_num(0.0)
    plain = estimator(name).fn(AdvantageInputs(rewards=_squeezed(rewards, GAPPED), scores=scores, mask=squeezed_mask,
                                               group=group, values=_squeezed(values, GAPPED)), opt)
    for got, want in zip(gapped, plain):
        if want is None:
            assert got is None
            continue
        assert bool((got[GAPPED == 0] == 0).all()) and torch.isfinite(got).all()
        assert torch.allclose(_squeezed(got, GAPPED).nan_to_num(0.0), want, atol=1e-6), name
        assert not torch.allclose(want[:, 0], torch.zeros(6))  # the first token sees the whole row

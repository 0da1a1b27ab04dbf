"""Unit tests for the PPO math (core.masked, core.logprobs, core.kl, core.advantages, core.ppo):
hand-computed values, gradients, padding invariance."""

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from core import ppo
from core.advantages import gae, per_token_rewards
from core.choices import AGG_MODES, KL_ESTIMATORS, kl_placement_error
from core.kl import NO_KL, AdaptiveKLController, FixedKLController, KLPenalty, kl_estimate
from core.logprobs import entropy_from_logits, logprobs_from_logits
from core.masked import explained_variance, masked_mean, masked_var, whiten

pytestmark = pytest.mark.unit

D = torch.float64
FAST = settings(max_examples=25, deadline=None)


def t(x):
    return torch.tensor(x, dtype=D)


def random_batch(seed, B, T):
    """Random float64 data with a right-padded mask (every row has >= 1 valid token)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(D)
    return g, mask


def pad_with_garbage(x, extra, value=float("nan")):
    """Append ``extra`` padding columns filled with garbage."""
    return torch.cat([x, torch.full((x.shape[0], extra), value, dtype=x.dtype)], dim=1)


# ------------------------------------------------------------------------ GAE


def test_gae_gamma_lam_one_is_reward_to_go_minus_value():
    r, v = t([[1.0, -2.0, 3.0, 0.5]]), t([[0.3, 0.1, -0.4, 2.0]])
    adv, ret = gae(r, v, torch.ones_like(r), gamma=1.0, lam=1.0)
    rtg = r.flip(1).cumsum(1).flip(1)
    torch.testing.assert_close(adv, rtg - v)
    torch.testing.assert_close(ret, rtg)


def test_gae_lam_zero_is_one_step_td_residual():
    r, v = t([[1.0, -2.0, 3.0, 0.5]]), t([[0.3, 0.1, -0.4, 2.0]])
    gamma = 0.9
    adv, _ = gae(r, v, torch.ones_like(r), gamma=gamma, lam=0.0)
    next_v = torch.cat([v[:, 1:], torch.zeros(1, 1, dtype=D)], dim=1)  # V after last = 0
    torch.testing.assert_close(adv, r + gamma * next_v - v)


def test_gae_hand_worked_with_padding():
    # Row 0: delta2 = 2 - 1.5 = 0.5; delta1 = 0.9*1.5 - 1 = 0.35; delta0 = 1 + 0.9 - 0.5 = 1.4
    # A2 = 0.5; A1 = 0.35 + 0.72*0.5 = 0.71; A0 = 1.4 + 0.72*0.71 = 1.9112
    # Row 1 has one valid token: A = 3 - 1 = 2, garbage after it must not leak in.
    r = t([[1.0, 0.0, 2.0], [3.0, 100.0, -50.0]])
    v = t([[0.5, 1.0, 1.5], [1.0, 40.0, 7.0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    adv, ret = gae(r, v, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, t([[1.9112, 0.71, 0.5], [2.0, 0.0, 0.0]]))
    torch.testing.assert_close(ret, t([[2.4112, 1.71, 2.0], [3.0, 0.0, 0.0]]))
    torch.testing.assert_close(ret, adv + v * mask)


def test_gae_outputs_are_detached():
    v = torch.zeros(1, 3, dtype=D, requires_grad=True)
    adv, ret = gae(torch.ones(1, 3, dtype=D), v, torch.ones(1, 3, dtype=D))
    assert not adv.requires_grad and not ret.requires_grad


@FAST
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 4), T=st.integers(1, 8))
def test_gae_gamma_lam_one_property(seed, B, T):
    g, mask = random_batch(seed, B, T)
    r, v = torch.randn(B, T, generator=g, dtype=D), torch.randn(B, T, generator=g, dtype=D)
    adv, ret = gae(r, v, mask, gamma=1.0, lam=1.0)
    rtg = (r * mask).flip(1).cumsum(1).flip(1) * mask
    torch.testing.assert_close(ret, rtg)
    torch.testing.assert_close(adv, (rtg - v) * mask)


# ------------------------------------------------------------------------ padding invariance


@FAST
@given(
    seed=st.integers(0, 2**31 - 1),
    B=st.integers(1, 4),
    T=st.integers(1, 8),
    extra=st.integers(1, 4),
    garbage=st.sampled_from([float("nan"), 1e6, -3.0]),
    gamma=st.floats(0.5, 1.0),
    lam=st.floats(0.0, 1.0),
)
def test_right_padding_invariance(seed, B, T, extra, garbage, gamma, lam):
    g, mask = random_batch(seed, B, T)
    r, v, kl, lp, old, adv_in, v_old, ret_in = (
        torch.randn(B, T, generator=g, dtype=D) for _ in range(8)
    )
    scores = torch.randn(B, generator=g, dtype=D)
    truncated = torch.rand(B, generator=g) < 0.5
    pmask = pad_with_garbage(mask, extra, 0.0)
    P = lambda x: pad_with_garbage(x, extra, garbage)  # noqa: E731
    valid = lambda x: x[:, :T]  # noqa: E731

    adv, ret = gae(r, v, mask, gamma, lam)
    padv, pret = gae(P(r), P(v), pmask, gamma, lam)
    torch.testing.assert_close(valid(padv), adv)
    torch.testing.assert_close(valid(pret), ret)
    assert (padv[:, T:] == 0).all() and (pret[:, T:] == 0).all()

    rew = per_token_rewards(kl, scores, mask, 0.1, truncated=truncated,
                                truncation_penalty=-1.0, reward_clip=1.0)
    prew = per_token_rewards(P(kl), scores, pmask, 0.1, truncated=truncated,
                                 truncation_penalty=-1.0, reward_clip=1.0)
    torch.testing.assert_close(valid(prew), rew)
    assert (prew[:, T:] == 0).all()

    for shift in (True, False):
        torch.testing.assert_close(valid(whiten(P(r), pmask, shift)), whiten(r, mask, shift))

    for agg in AGG_MODES:
        how = ppo.Aggregation(mode=agg, horizon=T)  # horizon pinned: by default it is the padded length
        a = ppo.policy_loss(lp, old, adv_in, mask, 0.2, 0.3, 3.0, how)
        b = ppo.policy_loss(P(lp), P(old), P(adv_in), pmask, 0.2, 0.3, 3.0, how)
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y)
        a = ppo.value_loss(v, v_old, ret_in, mask, 0.2, how)
        b = ppo.value_loss(P(v), P(v_old), P(ret_in), pmask, 0.2, how)
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y)


# ------------------------------------------------------------------------ policy loss


def _pg(ratios, advantages, **kw):
    old = torch.zeros(1, len(ratios), dtype=D)
    lp = torch.log(t([ratios])).requires_grad_(True)
    adv = t([advantages])
    loss, clip_frac, approx_kl = ppo.policy_loss(lp, old, adv, torch.ones_like(adv), **kw)
    loss.backward()
    return loss, clip_frac, approx_kl, lp.grad[0]


def test_policy_loss_positive_advantage_clips_above_only():
    ratios = [0.5, 1.0, 1.1, 1.5]
    loss, clip_frac, _, grad = _pg(ratios, [2.0] * 4, clip_low=0.2)
    # d(-A r)/d logprob = -A r, divided by 4 tokens; ratio 1.5 > 1.2 is clipped.
    torch.testing.assert_close(grad, t([-2 * 0.5 / 4, -2 * 1.0 / 4, -2 * 1.1 / 4, 0.0]))
    torch.testing.assert_close(loss, t(-2 * (0.5 + 1.0 + 1.1 + 1.2) / 4))
    torch.testing.assert_close(clip_frac, t(0.25))


def test_policy_loss_negative_advantage_clips_below_only():
    _, clip_frac, _, grad = _pg([0.5, 0.9, 1.5], [-1.0] * 3, clip_low=0.2)
    assert grad[0] == 0  # ratio < 0.8: clipped
    assert grad[1] != 0 and grad[2] != 0  # without dual clip, large ratios keep gradient
    torch.testing.assert_close(clip_frac, t(1 / 3))


def test_policy_loss_asymmetric_clip_range():
    # clip_low = 0.2, clip_high = 0.28 ("clip-higher").
    _, _, _, grad = _pg([1.25, 1.3], [1.0, 1.0], clip_low=0.2, clip_high=0.28)
    assert grad[0] != 0 and grad[1] == 0
    _, _, _, grad = _pg([1.25], [1.0], clip_low=0.2)  # symmetric: 1.25 > 1.2 is clipped
    assert grad[0] == 0
    _, _, _, grad = _pg([0.79, 0.81], [-1.0, -1.0], clip_low=0.2, clip_high=0.28)
    assert grad[0] == 0 and grad[1] != 0


def test_policy_loss_dual_clip():
    loss, clip_frac, _, grad = _pg([4.0], [-1.5], dual_clip=3.0)
    assert grad[0] == 0
    torch.testing.assert_close(loss, t(1.5 * 3.0))
    torch.testing.assert_close(clip_frac, t(1.0))
    loss, _, _, grad = _pg([2.0], [-1.5], dual_clip=3.0)  # below the cap: ordinary PPO
    torch.testing.assert_close(loss, t(1.5 * 2.0))
    assert grad[0] != 0
    loss, _, _, grad = _pg([4.0], [1.5], dual_clip=3.0)  # positive advantages unaffected
    torch.testing.assert_close(loss, t(-1.5 * 1.2))


def test_policy_loss_approx_kl_is_k2_and_detached():
    ratios = [0.5, 1.0, 2.0]
    _, clip_frac, approx_kl, _ = _pg(ratios, [1.0, 1.0, 1.0])
    expected = sum(0.5 * math.log(r) ** 2 for r in ratios) / 3
    torch.testing.assert_close(approx_kl, t(expected))
    assert not approx_kl.requires_grad and not clip_frac.requires_grad


def test_policy_loss_validates_clip_arguments():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo.policy_loss(x, x, x, torch.ones(1, 2), dual_clip=1.0)
    with pytest.raises(ValueError, match="clip_low"):
        ppo.policy_loss(x, x, x, torch.ones(1, 2), clip_low=0.0)


# ------------------------------------------------------------------------ value loss


def test_value_loss_clipping_and_gradient():
    # V_old = 0, R = 1, c = 0.2.
    # V=0.5: clip(V) = 0.2, (0.2-1)^2 = 0.64 > 0.25 -> clipped binds, zero grad.
    # V=0.1: inside the clip range, grad = (V - R) / 3.
    # V=-0.5: clip(V) = -0.2, 1.44 < 2.25 -> unclipped binds, grad = (V - R) / 3.
    v = t([[0.5, 0.1, -0.5]]).requires_grad_(True)
    old, ret, mask = torch.zeros(1, 3, dtype=D), torch.ones(1, 3, dtype=D), torch.ones(1, 3, dtype=D)
    loss, frac = ppo.value_loss(v, old, ret, mask, clip=0.2)
    loss.backward()
    torch.testing.assert_close(loss, t(0.5 * (0.64 + 0.81 + 2.25) / 3))
    torch.testing.assert_close(v.grad, t([[0.0, -0.9 / 3, -1.5 / 3]]))
    torch.testing.assert_close(frac, t(1 / 3))


def test_value_loss_clips_around_old_values():
    # V_old = 1, R = 0, c = 0.2: V = 2 -> clip(V) = 1.2; 1.44 < 4 so unclipped binds.
    # V = 0.5 -> clip(V) = 0.8; 0.64 > 0.25 so the clipped term binds.
    v = t([[2.0, 0.5]])
    loss, frac = ppo.value_loss(v, torch.ones_like(v), torch.zeros_like(v), torch.ones_like(v), clip=0.2)
    torch.testing.assert_close(loss, t(0.5 * (4.0 + 0.64) / 2))
    torch.testing.assert_close(frac, t(0.5))


def test_value_loss_without_clip():
    v = t([[0.5, 0.1, -0.5]])
    loss, frac = ppo.value_loss(v, torch.zeros_like(v), torch.ones_like(v), torch.ones_like(v), clip=None)
    torch.testing.assert_close(loss, t(0.5 * (0.25 + 0.81 + 2.25) / 3))
    assert frac == 0


# ------------------------------------------------------------------------ KL estimators


@FAST
@given(st.lists(st.tuples(st.floats(-20, 0), st.floats(-20, 0)), min_size=1, max_size=16))
def test_kl_k2_k3_non_negative(pairs):
    lp, ref = t([[a for a, _ in pairs]]), t([[b for _, b in pairs]])
    for est in ("k2", "k3"):
        assert (kl_estimate(lp, ref, est) >= 0).all()
    for est in KL_ESTIMATORS:
        assert (kl_estimate(lp, lp, est) == 0).all()


def test_kl_estimators_exact_expectation_two_point():
    p, q = t([0.3, 0.7]), t([0.6, 0.4])
    kl_pq = (p * (p / q).log()).sum()
    expect = {e: (p * kl_estimate(p.log(), q.log(), e)).sum() for e in KL_ESTIMATORS}
    torch.testing.assert_close(expect["k1"], kl_pq)
    torch.testing.assert_close(expect["k3"], kl_pq)  # unbiased for KL(p||q), not KL(q||p)
    torch.testing.assert_close(expect["k2"], 0.5 * (p * (p / q).log() ** 2).sum())
    assert expect["k2"] > 0 and not torch.isclose(expect["k3"], (q * (q / p).log()).sum())


def test_kl_loss_hand_computed_value_and_gradient():
    """Token-mean over the valid tokens; d k3 / d lp = 1 - exp(ref - lp), d k2 / d lp = lp - ref;
    padding (even inf garbage) contributes nothing, to the loss or the gradient."""
    lp = t([[-1.0, -2.0, float("inf")], [-0.5, -1.5, -3.0]]).requires_grad_(True)
    ref = t([[-1.2, -1.0, 7.0], [-0.5, -2.5, -2.0]])
    mask = t([[1, 1, 0], [1, 1, 1]])
    valid = mask.bool()
    r = (ref - lp.detach())[valid]
    for est, value, grad in (("k3", torch.exp(r) - 1 - r, 1 - torch.exp(r)), ("k2", 0.5 * r**2, -r)):
        lp.grad = None
        loss, mean = ppo.kl_loss(lp, ref, mask, est)
        loss.backward()
        torch.testing.assert_close(loss, value.mean())
        torch.testing.assert_close(mean, value.mean())
        torch.testing.assert_close(lp.grad[valid], grad / 5)
        assert lp.grad[~valid].eq(0).all()


def test_kl_gradient_depends_on_placement():
    """Exact expectations over a categorical policy pi = softmax(z) and reference q. In the
    reward (a constant to PPO: the score-function gradient E[k(y) grad log pi(y)]) only k1
    gives grad KL(pi || q); k3 there pulls with a fraction of it. In the loss (gradient through
    log pi: E[grad k(y)]) k2 gives grad KL(pi || q) and k3 grad KL(q || pi)."""
    z = torch.tensor([0.3, -0.2, 0.1, 0.05], dtype=D, requires_grad=True)
    q = torch.softmax(torch.tensor([0.25, -0.1, 0.1, 0.0], dtype=D), -1)

    def grad(f):
        z.grad = None
        f().backward()
        return z.grad.clone()

    def expected(est, in_loss):
        log_pi = torch.log_softmax(z, -1)
        k = kl_estimate(log_pi, q.log(), est)
        pi = log_pi.exp().detach()
        return (pi * k).sum() if in_loss else (pi * k.detach() * log_pi).sum()

    forward_kl = grad(lambda: (torch.softmax(z, -1) * (torch.log_softmax(z, -1) - q.log())).sum())
    reverse_kl = grad(lambda: (q * (q.log() - torch.log_softmax(z, -1))).sum())
    torch.testing.assert_close(grad(lambda: expected("k1", False)), forward_kl)
    torch.testing.assert_close(grad(lambda: expected("k2", True)), forward_kl)
    torch.testing.assert_close(grad(lambda: expected("k3", True)), reverse_kl)
    in_reward = grad(lambda: expected("k3", False))
    assert float(in_reward.norm()) < 0.2 * float(forward_kl.norm())  # near the reference: a few percent


@pytest.mark.parametrize("placement, estimator, message", [
    ("reward", "k3", "does not give the KL's gradient"), ("reward", "k2", "placement=loss"),
    ("loss", "k1", "zero expected gradient"), ("gradient", "k1", "placement='gradient' is unknown"),
])
def test_kl_placement_refuses_what_misleads(placement, estimator, message):
    assert message in kl_placement_error(placement, estimator)


def test_kl_placement_accepts_the_sound_pairs():
    assert [kl_placement_error(*pair) for pair in (("reward", "k1"), ("loss", "k3"), ("loss", "k2"))] == [None] * 3


def test_a_kl_penalty_is_in_the_loss_or_in_the_rewards_and_refuses_what_misleads():
    in_loss, in_reward = KLPenalty(beta=0.3, estimator="k3", placement="loss"), KLPenalty(beta=0.3)
    assert (in_loss.in_loss, in_loss.reward_beta) == (True, 0.0)
    assert (in_reward.in_loss, in_reward.reward_beta) == (False, 0.3)
    assert not NO_KL.in_loss and NO_KL.reward_beta == 0.0
    with pytest.raises(ValueError, match="^KLPenalty: ppo.kl.estimator=k1 in the loss has zero expected gradient"):
        KLPenalty(beta=0.1, placement="loss")


def test_kl_unknown_estimator():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_estimate(torch.zeros(1, 2), torch.zeros(1, 2), "k4")


# ------------------------------------------------------------------------ whitening


@FAST
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 4), T=st.integers(2, 8))
def test_whiten_masked_stats(seed, B, T):
    g, mask = random_batch(seed, B, T)
    mask[0, :2] = 1.0  # need two valid entries for a non-degenerate variance
    x = 3.0 + 5.0 * torch.randn(B, T, generator=g, dtype=D)
    garbage = torch.where(mask.bool(), x, t(1e9))
    w = whiten(garbage, mask)
    # eps=1e-8 in the denominator: the whitened variance is var / (var + eps), not exactly 1.
    var = masked_var(x, mask)
    unit = var / (var + 1e-8)
    torch.testing.assert_close(masked_mean(w, mask), t(0.0))
    torch.testing.assert_close(masked_var(w, mask), unit, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w, whiten(x, mask))
    s = whiten(x, mask, shift_mean=False)
    torch.testing.assert_close(masked_mean(s, mask), masked_mean(x, mask))
    torch.testing.assert_close(masked_var(s, mask), unit, rtol=1e-6, atol=1e-6)


def test_whiten_hand_values():
    x, mask = t([[1.0, 2.0, 3.0, 99.0]]), t([[1, 1, 1, 0]])
    torch.testing.assert_close(masked_var(x, mask), t(2 / 3))  # biased
    s = math.sqrt(1.5)
    torch.testing.assert_close(whiten(x, mask, eps=0.0), t([[-s, 0.0, s, 0.0]]))


def test_masked_mean_dim():
    x, mask = t([[1.0, 3.0, 50.0], [4.0, 0.0, 0.0]]), t([[1, 1, 0], [0, 0, 0]])
    torch.testing.assert_close(masked_mean(x, mask, dim=1), t([2.0, 0.0]))


# ------------------------------------------------------------------------ temperature / entropy


def test_logprobs_temperature():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=g, dtype=D)
    tokens = torch.randint(0, 5, (2, 3), generator=g)
    lp = logprobs_from_logits(logits, tokens, temperature=0.7)
    ref = F.log_softmax(logits / 0.7, -1).gather(-1, tokens[..., None])[..., 0]
    torch.testing.assert_close(lp, ref)
    assert not torch.allclose(lp, logprobs_from_logits(logits, tokens))
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="temperature"):
            logprobs_from_logits(logits, tokens, temperature=bad)


def test_logprobs_bf16_upcast():
    logits = torch.randn(1, 2, 7)
    tokens = torch.tensor([[1, 6]])
    lp = logprobs_from_logits(logits.bfloat16(), tokens)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, logprobs_from_logits(logits.bfloat16().float(), tokens))


def test_entropy_tempered_and_uniform():
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(1), dtype=D)
    p = torch.softmax(logits / 1.5, -1)
    torch.testing.assert_close(entropy_from_logits(logits, 1.5), -(p * p.log()).sum(-1))
    assert not torch.allclose(entropy_from_logits(logits, 1.5), entropy_from_logits(logits))
    torch.testing.assert_close(entropy_from_logits(torch.zeros(1, 2, 5, dtype=D), 0.3),
                               torch.full((1, 2), math.log(5), dtype=D))
    with pytest.raises(ValueError, match="temperature"):
        entropy_from_logits(logits, 0.0)


# ------------------------------------------------------------------------ aggregation


LOSS = t([[1.0, 2.0, 3.0, 4.0], [10.0, 123.0, 456.0, 789.0]])
MASK = t([[1, 1, 1, 1], [1, 0, 0, 0]])


def test_aggregation_modes_hand_computed():
    agg = lambda mode, **kw: ppo.aggregate_loss(LOSS, MASK, ppo.Aggregation(mode=mode, **kw))  # noqa: E731
    torch.testing.assert_close(agg("token-mean"), t(20 / 5))
    torch.testing.assert_close(agg("seq-mean-token-mean"), t((2.5 + 10) / 2))
    torch.testing.assert_close(agg("seq-mean-token-sum-norm"), t((10 / 4 + 10 / 4) / 2))
    torch.testing.assert_close(agg("seq-mean-token-sum-norm", horizon=8), t((10 / 8 + 10 / 8) / 2))
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-mean, seq-mean-token-sum-norm"):
        agg("sum")


def test_aggregation_global_counts_sum_over_ranks():
    for mode, kw in (("token-mean", {"global_tokens": 5}), ("seq-mean-token-mean", {"global_seqs": 2}),
                     ("seq-mean-token-sum-norm", {"global_seqs": 2})):
        full = ppo.aggregate_loss(LOSS, MASK, ppo.Aggregation(mode=mode))
        ranks = sum(ppo.aggregate_loss(LOSS[i:i + 1], MASK[i:i + 1], ppo.Aggregation(mode=mode, **kw, horizon=4))
                    for i in (0, 1))
        torch.testing.assert_close(ranks, full)
        # Without the global count each rank normalises locally: a different (wrong) number.
        local = sum(ppo.aggregate_loss(LOSS[i:i + 1], MASK[i:i + 1], ppo.Aggregation(mode=mode, horizon=4))
                    for i in (0, 1))
        assert not torch.isclose(local, full)


def test_aggregation_ignores_nan_padding():
    loss = torch.where(MASK.bool(), LOSS, t(float("nan")))
    for mode in AGG_MODES:
        how = ppo.Aggregation(mode=mode)
        torch.testing.assert_close(ppo.aggregate_loss(loss, MASK, how), ppo.aggregate_loss(LOSS, MASK, how))


def test_aggregation_skips_empty_sequences():
    loss = torch.cat([LOSS, t([[7.0, 7.0, 7.0, 7.0]])])
    mask = torch.cat([MASK, torch.zeros(1, 4, dtype=D)])
    torch.testing.assert_close(ppo.aggregate_loss(loss, mask, ppo.Aggregation(mode="seq-mean-token-mean")), t(6.25))


# ------------------------------------------------------------------------ per-token rewards


def test_per_token_rewards_layout():
    kl = t([[0.1, 0.2, 0.3], [0.5, float("nan"), 9.0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    scores = t([2.0, -7.0])
    r = per_token_rewards(kl, scores, mask, 0.5)
    torch.testing.assert_close(r, t([[-0.05, -0.1, -0.15 + 2.0], [-0.25 - 7.0, 0.0, 0.0]]))
    # Truncation penalty on the truncated row only; clip applies to the score, not the penalty.
    r = per_token_rewards(kl, scores, mask, 0.5, truncated=torch.tensor([False, True]),
                              truncation_penalty=-1.0, reward_clip=5.0)
    torch.testing.assert_close(r, t([[-0.05, -0.1, -0.15 + 2.0], [-0.25 - 5.0 - 1.0, 0.0, 0.0]]))


def test_per_token_rewards_score_not_broadcast():
    mask = t([[1, 1, 1, 1, 0]])
    r = per_token_rewards(torch.zeros(1, 5, dtype=D), t([3.0]), mask, beta=0.1)
    torch.testing.assert_close(r, t([[0.0, 0.0, 0.0, 3.0, 0.0]]))


def test_per_token_rewards_bad_rows():
    with pytest.raises(ValueError, match="no valid tokens"):
        per_token_rewards(torch.zeros(2, 3), torch.zeros(2), torch.tensor([[1.0, 0, 0], [0, 0, 0]]), 0.1)
    with pytest.raises(ValueError, match=r"scores shape \(3,\)"):
        per_token_rewards(torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3), 0.1)


# ------------------------------------------------------------------------ KL controllers


def test_adaptive_kl_controller_steps():
    c = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    c.update(7.0, n_steps=100)  # error = 1/6, inside the clip
    expected = 0.1 * (1 + (7 / 6 - 1) * 100 / 10000)
    assert c.value == pytest.approx(expected, rel=1e-12)
    c.update(1e6, n_steps=500)  # error clipped to +0.2
    expected *= 1 + 0.2 * 500 / 10000
    assert c.value == pytest.approx(expected, rel=1e-12)
    c.update(0.0, n_steps=500)  # error -1 clipped to -0.2
    expected *= 1 - 0.2 * 500 / 10000
    assert c.value == pytest.approx(expected, rel=1e-12)


def test_fixed_kl_controller_and_validation():
    c = FixedKLController(0.05)
    c.update(100.0, 1000)
    assert c.value == 0.05
    for args in ((0.1, 0.0, 100), (0.1, 6.0, 0), (-0.1, 6.0, 100)):
        with pytest.raises(ValueError):
            AdaptiveKLController(*args)
    with pytest.raises(ValueError):
        FixedKLController(-1.0)


# ------------------------------------------------------------------------ ptx, explained variance


def test_ptx_loss_matches_cross_entropy():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 4, 7, generator=g, dtype=D)
    labels = torch.randint(0, 7, (2, 4), generator=g)
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    labels[0, 3], labels[1, 2:] = 10**6, -100  # padding labels are never read
    valid = mask.bool()
    torch.testing.assert_close(ppo.ptx_loss(logits, labels, mask), F.cross_entropy(logits[valid], labels[valid]))


def test_explained_variance():
    ret, mask = t([[1.0, 2.0, 4.0, 1e6]]), t([[1, 1, 1, 0]])
    torch.testing.assert_close(explained_variance(ret, ret, mask), t(1.0))
    torch.testing.assert_close(explained_variance(torch.zeros_like(ret), ret, mask), t(0.0))
    assert math.isnan(explained_variance(ret, t([[3.0, 3.0, 3.0, 0.0]]), mask))


class ThreadAllReduce:
    """all-reduce(SUM) across ``n`` threads, each standing for one process holding a part of
    the batch: every caller passes its local scalars and gets the sums over all callers."""

    def __init__(self, n):
        self.barrier, self.parts, self.calls = threading.Barrier(n), {}, 0

    def __call__(self, values):
        self.parts[threading.get_ident()] = [float(v) for v in values]
        self.barrier.wait()
        sums = [math.fsum(column) for column in zip(*self.parts.values())]
        self.calls += 1
        self.barrier.wait()  # every part is read before the next round overwrites it
        return sums


def run_split(fn, rows, *tensors):
    """``fn(*parts, reduce=...)`` on each row block of ``tensors`` concurrently, results in order."""
    reduce = ThreadAllReduce(len(rows))
    with ThreadPoolExecutor(len(rows)) as pool:
        results = list(pool.map(lambda r: fn(*(x[r] for x in tensors), reduce=reduce), rows))
    return results, reduce


@FAST
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(2, 6), T=st.integers(2, 8), shift=st.booleans())
def test_whiten_split_over_processes_equals_one_process(seed, B, T, shift):
    g, mask = random_batch(seed, B, T)
    x = 3.0 + 5.0 * torch.randn(B, T, generator=g, dtype=D)
    cut = int(torch.randint(1, B, (1,), generator=g))
    parts, reduce = run_split(lambda x, m, reduce: whiten(x, m, shift, reduce=reduce),
                              [slice(0, cut), slice(cut, B)], x, mask)
    torch.testing.assert_close(torch.cat(parts), whiten(x, mask, shift))
    assert reduce.calls == 2 * 2  # two rounds (sums, then squared deviations) per process


def test_whiten_split_hand_values_and_a_part_without_tokens():
    # Global valid entries 1, 2, 3: mean 2, biased variance 2/3; the last part has none.
    x, mask = t([[1.0, 2.0], [3.0, 99.0], [7.0, 8.0]]), t([[1, 1], [1, 0], [0, 0]])
    parts, _ = run_split(lambda x, m, reduce: whiten(x, m, eps=0.0, reduce=reduce),
                         [slice(0, 1), slice(1, 2), slice(2, 3)], x, mask)
    s = math.sqrt(1.5)
    torch.testing.assert_close(torch.cat(parts), t([[-s, 0.0], [s, 0.0], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="whiten: mask has no valid tokens"):
        run_split(lambda x, m, reduce: whiten(x, m, reduce=reduce), [slice(0, 1), slice(1, 2)],
                  x[2:].repeat(2, 1), mask[2:].repeat(2, 1))


@FAST
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(2, 6), T=st.integers(2, 8))
def test_explained_variance_split_over_processes_equals_one_process(seed, B, T):
    g, mask = random_batch(seed, B, T)
    ret, val = torch.randn(B, T, generator=g, dtype=D), torch.randn(B, T, generator=g, dtype=D)
    cut = int(torch.randint(1, B, (1,), generator=g))
    parts, _ = run_split(explained_variance, [slice(0, cut), slice(cut, B)], val, ret, mask)
    whole = explained_variance(val, ret, mask)
    for part in parts:  # every process gets the global value
        torch.testing.assert_close(part, whole)


def test_explained_variance_split_hand_value():
    # R = 1, 2, 4: Var 14/9. R - V = 0, 0, 2: Var 8/9. EV = 1 - 8/14 = 3/7.
    ret, val, mask = t([[1.0, 2.0], [4.0, 50.0]]), t([[1.0, 2.0], [2.0, -9.0]]), t([[1, 1], [1, 0]])
    parts, _ = run_split(explained_variance, [slice(0, 1), slice(1, 2)], val, ret, mask)
    assert all(float(p) == pytest.approx(3 / 7, rel=1e-12) for p in parts)
    assert float(explained_variance(val, ret, mask)) == pytest.approx(3 / 7, rel=1e-12)


# ------------------------------------------------------------------------ bad input


def test_shape_mismatch_message_names_arguments():
    with pytest.raises(ValueError, match=r"^gae: rewards shape \(2, 5\) does not match mask shape \(2, 4\)$"):
        gae(torch.zeros(2, 5), torch.zeros(2, 4), torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"policy_loss: advantages shape \(2, 3\)"):
        ppo.policy_loss(torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"logprobs_from_logits: tokens shape \(2, 3\)"):
        logprobs_from_logits(torch.zeros(2, 4, 5), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"kl_estimate: logprobs shape \(1, 2\)"):
        kl_estimate(torch.zeros(1, 2), torch.zeros(1, 3))


@pytest.mark.parametrize("call", [
    lambda x, m: masked_mean(x, m),
    lambda x, m: masked_var(x, m),
    lambda x, m: whiten(x, m),
    lambda x, m: gae(x, x, m),
    lambda x, m: ppo.policy_loss(x, x, x, m),
    lambda x, m: ppo.value_loss(x, x, x, m),
    lambda x, m: ppo.aggregate_loss(x, m),
    lambda x, m: explained_variance(x, x, m),
    lambda x, m: ppo.ptx_loss(torch.zeros(2, 3, 4), x.long(), m),
    lambda x, m: per_token_rewards(x, torch.zeros(2), m, 0.1),
])
def test_empty_mask_raises(call):
    with pytest.raises(ValueError, match="no valid tokens"):
        call(torch.zeros(2, 3), torch.zeros(2, 3))


def test_policy_loss_is_finite_for_a_runaway_log_ratio():
    """A token whose log-ratio overflows exp in fp32 (here 100) with a negative advantage and
    no dual clip: the clamp keeps the loss finite, and equal to -A * e^LIMIT for that token."""
    from core.ppo import LOG_RATIO_LIMIT, policy_loss

    logprobs = torch.tensor([[0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-100.0, 0.0]])
    adv = torch.tensor([[-1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0]])
    loss, clip_frac, _ = policy_loss(logprobs, old, adv, mask)
    assert torch.isfinite(loss)
    expected = (math.exp(LOG_RATIO_LIMIT) + (-1.0)) / 2  # token 0: -A * ratio; token 1: -A * 1
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    assert torch.isfinite(logprobs.grad).all()


# ------------------------------------------------------------------------ off-policy correction


def _weights(prox, behav, mask, mode, cap=2.0):
    return ppo.behaviour_weights(t(prox), t(behav), t(mask), mode, cap)


def test_behaviour_weights_by_hand():
    # w = pi_prox / pi_behaviour = exp(prox - behav): 0.5, 1, 3, and a padding column.
    behav = [[math.log(0.4), math.log(0.5), math.log(0.1), 5.0]]
    prox = [[math.log(0.2), math.log(0.5), math.log(0.3), -5.0]]
    mask = [[1.0, 1.0, 1.0, 0.0]]
    w, capped = _weights(prox, behav, mask, "tis", cap=2.0)
    torch.testing.assert_close(w, t([[0.5, 1.0, 2.0, 0.0]]))  # 3 truncated to the cap
    assert capped.tolist() == [[False, False, True, False]]
    w, capped = _weights(prox, behav, mask, "decoupled", cap=2.0)
    torch.testing.assert_close(w, t([[0.5, 1.0, 0.0, 0.0]]))  # 3 > cap: the token is left out
    assert capped.tolist() == [[False, False, True, False]]
    w, capped = _weights(prox, behav, mask, "none")
    torch.testing.assert_close(w, t([[1.0, 1.0, 1.0, 0.0]]))
    assert not capped.any()
    w, _ = _weights(prox, behav, mask, "decoupled", cap=4.0)  # a looser cap keeps it
    torch.testing.assert_close(w, t([[0.5, 1.0, 3.0, 0.0]]))


def test_behaviour_weights_are_detached_finite_and_validated():
    prox = torch.zeros(1, 2, requires_grad=True)
    behav = torch.tensor([[-200.0, 0.0]])  # w = e^200 overflows float32 unless clamped
    for mode in ("tis", "decoupled"):
        w, capped = ppo.behaviour_weights(prox, behav, torch.ones(1, 2), mode, 2.0)
        assert torch.isfinite(w).all() and not w.requires_grad and capped.tolist() == [[True, False]]
    prox, behav = prox.detach().double(), behav.double()
    with pytest.raises(ValueError, match="unknown mode 'is'"):
        ppo.behaviour_weights(prox, behav, torch.ones(1, 2, dtype=D), "is")
    with pytest.raises(ValueError, match="cap must be"):
        ppo.behaviour_weights(prox, behav, torch.ones(1, 2, dtype=D), "tis", 0.5)


def test_policy_loss_weights_each_token_by_hand():
    # ratios 1.0 and 1.5 (clipped at 1.2), advantages 2 and 1, weights 0.5 and 2:
    # loss = -(0.5 * 2 * 1.0 + 2 * 1 * 1.2) / 2 tokens; only token 0 has a gradient,
    # d/dlogprob0 = -0.5 * 2 * 1.0 / 2.
    old = torch.zeros(1, 2, dtype=D)
    lp = torch.log(t([[1.0, 1.5]])).requires_grad_(True)
    loss, clip_frac, _ = ppo.policy_loss(lp, old, t([[2.0, 1.0]]), torch.ones(1, 2, dtype=D),
                                         weights=t([[0.5, 2.0]]))
    torch.testing.assert_close(loss, t(-(0.5 * 2 * 1.0 + 2 * 1 * 1.2) / 2))
    loss.backward()
    torch.testing.assert_close(lp.grad, t([[-0.5 * 2 * 1.0 / 2, 0.0]]))
    torch.testing.assert_close(clip_frac, t(0.5))  # the weight does not change what is clipped


def test_policy_loss_with_unit_weights_equals_unweighted():
    g = torch.Generator().manual_seed(3)
    lp, old, adv = (torch.randn(3, 5, generator=g, dtype=D) * 0.3 for _ in range(3))
    mask = (torch.rand(3, 5, generator=g) > 0.3).to(D)
    mask[:, 0] = 1
    ones, _ = ppo.behaviour_weights(old, old, mask, "tis")
    a = ppo.policy_loss(lp, old, adv, mask, weights=ones)
    b = ppo.policy_loss(lp, old, adv, mask)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)

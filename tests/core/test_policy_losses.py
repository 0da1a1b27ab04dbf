"""Unit tests for GSPO and CISPO (core/policy_losses.py, ``ppo.policy_loss``): losses, gradients
and clip fractions computed by hand; padding and a multi-turn row's masked context never count."""
import math

import pytest
import torch

from core.choices import POLICY_LOSS_TABLE, POLICY_LOSSES, policy_loss_error
from core.policy_losses import cispo_loss, gspo_loss
from core.ppo import Aggregation, policy_loss
from learner.objectives import loss_terms

pytestmark = pytest.mark.unit

D = torch.float64
SEQ = Aggregation(mode="seq-mean-token-mean")


def t(x):
    return torch.tensor(x, dtype=D)


def gspo_inputs(context=0.0):
    """Row 0: log-ratios 0.1, -0.3 (mean -0.1, s = e^-0.1); row 1: 0.2, a masked context position
    (log-ratio ``context``), 0.4 (mean 0.3, s = e^0.3 = 1.35, clipped at 1.2)."""
    old = t([[-1.0, -2.0, -0.7], [-0.5, -1.5, -1.1]])
    lp = (old + t([[0.1, -0.3, 0.0], [0.2, context, 0.4]]))
    adv = t([[1.0, 3.0, 0.0], [2.0, 2.0, 2.0]])
    mask = t([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    return lp.requires_grad_(True), old, adv, mask


def test_gspo_by_hand():
    lp, old, adv, mask = gspo_inputs()
    loss, clip_frac, approx_kl = gspo_loss(lp, old, adv, mask, 0.2, 0.2, SEQ)
    s0 = math.exp(-0.1)
    # row 0 unclipped: mean(-1 * s0, -3 * s0); row 1 clipped: -2 * 1.2 on each token.
    torch.testing.assert_close(loss, t((-(1 + 3) / 2 * s0 - 2.4) / 2))
    loss.backward()
    # GSPO-token: token t's gradient is -A_t * s_i / |y_i| / n_seqs (the sequence ratio detached
    # in value, log pi_t's gradient), so row 0's tokens differ by their advantages; row 1 is clipped.
    torch.testing.assert_close(lp.grad, t([[-1 * s0 / 4, -3 * s0 / 4, 0.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(clip_frac, t(0.5))
    torch.testing.assert_close(approx_kl, t(0.5 * (0.01 + 0.09 + 0.04 + 0.16) / 4))


def test_gspo_ignores_the_masked_context_and_refuses_another_aggregation():
    a = gspo_loss(*gspo_inputs(context=0.0), 0.2, 0.2, SEQ)[0]
    b = gspo_loss(*gspo_inputs(context=50.0), 0.2, 0.2, SEQ)[0]
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="GSPO aggregates seq-mean-token-mean, got token-mean"):
        gspo_loss(*gspo_inputs(), 0.2, 0.2, Aggregation())


def test_gspo_with_one_token_rows_is_ppo_per_sequence():
    # a row of one token: s_i is its token ratio, so GSPO and PPO agree
    g = torch.Generator().manual_seed(0)
    old, adv = torch.randn(4, 1, generator=g, dtype=D), torch.randn(4, 1, generator=g, dtype=D)
    lp = old + 0.3 * torch.randn(4, 1, generator=g, dtype=D)
    mask = torch.ones(4, 1, dtype=D)
    torch.testing.assert_close(gspo_loss(lp, old, adv, mask, 0.2, 0.28, SEQ)[0],
                               policy_loss(lp, old, adv, mask, 0.2, 0.28, agg=SEQ)[0])


def test_cispo_by_hand_every_token_keeps_its_gradient():
    # ratios e^0.1, e^-0.5 (0.61, clipped up to 0.8), e^0.4 (1.49, clipped down to 1.2)
    lp = t([[-1.0, -2.0, -0.5, 7.0]]).requires_grad_(True)
    old = lp.detach() - t([[0.1, -0.5, 0.4, 0.0]])
    adv, mask = t([[1.0, -1.0, 2.0, 5.0]]), t([[1.0, 1.0, 1.0, 0.0]])
    loss, clip_frac, _ = cispo_loss(lp, old, adv, mask, 0.2, 0.2)
    w = [math.exp(0.1), 0.8, 1.2]
    torch.testing.assert_close(loss, t(-(w[0] * 1 * -1.0 + w[1] * -1 * -2.0 + w[2] * 2 * -0.5) / 3))
    loss.backward()
    # d/dlog pi_t = -w_t * A_t / 3: the clipped tokens too (PPO's clip would zero theirs)
    torch.testing.assert_close(lp.grad, t([[-w[0] / 3, w[1] / 3, -w[2] * 2 / 3, 0.0]]))
    torch.testing.assert_close(clip_frac, t(2 / 3))
    ppo_lp = lp.detach().clone().requires_grad_(True)
    policy_loss(ppo_lp, old, adv, mask, 0.2, 0.2)[0].backward()
    assert ppo_lp.grad[0, 2] == 0 and lp.grad[0, 2] != 0


def test_weights_multiply_each_token():
    lp, old, adv, mask = gspo_inputs()
    weights = t([[0.5, 2.0, 9.0], [1.0, 9.0, 1.0]])
    plain = gspo_loss(lp, old, adv * t([[0.5, 2.0, 0.0], [1.0, 0.0, 1.0]]), mask, 0.2, 0.2, SEQ)[0]
    torch.testing.assert_close(gspo_loss(lp, old, adv, mask, 0.2, 0.2, SEQ, weights=weights)[0], plain)
    plain = cispo_loss(lp, old, adv * t([[0.5, 2.0, 0.0], [1.0, 0.0, 1.0]]), mask)[0]
    torch.testing.assert_close(cispo_loss(lp, old, adv, mask, weights=weights)[0], plain)


def test_the_loss_table_has_every_name_and_the_aggregation_rules():
    assert set(loss_terms.POLICY_LOSSES) == set(POLICY_LOSSES) == {row.name for row in POLICY_LOSS_TABLE}
    assert policy_loss_error("gspo", "seq-mean-token-mean", None) is None
    assert policy_loss_error("gspo", "token-mean", None) == (
        "ppo.policy_loss=gspo aggregates seq-mean-token-mean (its length normalisation); set "
        "ppo.agg=seq-mean-token-mean or leave it out, not token-mean")
    assert policy_loss_error("cispo", "seq-mean-token-mean", None) is None  # as verl: cispo takes ppo.agg
    assert policy_loss_error("cispo", "token-mean", 3.0) == ("ppo.dual_clip applies to ppo.policy_loss=ppo only; "
                                                             "leave it out with cispo")

"""core/preference.py against values and gradients worked out by hand."""
import math

import pytest
import torch

from core.preference import bradley_terry_loss, pair_accuracy, response_nll

pytestmark = pytest.mark.unit

D = torch.float64


def t(x, grad=False):
    return torch.tensor(x, dtype=D, requires_grad=grad)


# ------------------------------------------------------------------------ Bradley-Terry

def test_bradley_terry_value_and_gradient_by_hand():
    # differences chosen - rejected = [1, -1]:
    # loss = (log(1 + e^-1) + log(1 + e^1)) / 2 = (0.3132617 + 1.3132617) / 2
    # d/d chosen_i = -sigmoid(-d_i) / 2 = [-0.2689414 / 2, -0.7310586 / 2]; rejected: the opposite
    chosen, rejected = t([2.0, 0.0], grad=True), t([1.0, 1.0], grad=True)
    loss = bradley_terry_loss(chosen, rejected)
    loss.backward()
    assert loss.item() == pytest.approx(0.8132616875182228, abs=1e-12)
    assert chosen.grad.tolist() == pytest.approx([-0.13447071068499755, -0.36552928931500245], abs=1e-12)
    assert rejected.grad.tolist() == pytest.approx([0.13447071068499755, 0.36552928931500245], abs=1e-12)


def test_bradley_terry_margin_by_hand():
    # margin 0.5: d - m = [0.5, -1.5]; loss = (log(1 + e^-0.5) + log(1 + e^1.5)) / 2
    chosen, rejected = t([2.0, 0.0], grad=True), t([1.0, 1.0])
    loss = bradley_terry_loss(chosen, rejected, margin=0.5)
    loss.backward()
    assert loss.item() == pytest.approx(1.0877451310814297, abs=1e-12)
    assert chosen.grad.tolist() == pytest.approx([-0.1887703343990727, -0.4087872380968218], abs=1e-12)
    # a per-pair margin equal to the scalar gives the same loss
    assert bradley_terry_loss(chosen, rejected, margin=t([0.5, 0.5])).item() == pytest.approx(loss.item())


def test_bradley_terry_normalizer_sums_pieces_to_the_mean():
    c, r = t([0.3, -1.0, 2.0, 0.5]), t([0.1, 0.4, -2.0, 0.5])
    whole = bradley_terry_loss(c, r)
    halves = bradley_terry_loss(c[:2], r[:2], normalizer=4) + bradley_terry_loss(c[2:], r[2:], normalizer=4)
    assert halves.item() == pytest.approx(whole.item(), abs=1e-12)
    # equal scores: the loss is log 2 whatever the value
    assert bradley_terry_loss(t([5.0]), t([5.0])).item() == pytest.approx(math.log(2))


def test_bradley_terry_is_finite_far_from_zero_and_checks_shapes():
    loss = bradley_terry_loss(t([-1000.0]), t([1000.0]))
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(2000.0)
    with pytest.raises(ValueError, match="shapes differ"):
        bradley_terry_loss(t([1.0, 2.0]), t([1.0]))
    with pytest.raises(ValueError, match="1-D"):
        bradley_terry_loss(t([[1.0]]), t([[1.0]]))


def test_pair_accuracy_counts_ties_as_wrong():
    assert pair_accuracy(t([1.0, 2.0, 3.0, 0.0]), t([0.0, 2.0, 1.0, 1.0])).item() == 0.5


# ------------------------------------------------------------------------ SFT loss

def _example():
    """One row: prompt = ids[0:2], response = ids[2:4]; vocabulary of 3.

    logits[0] predicts ids[1] (a prompt token): strongly wrong, must not count.
    logits[1] predicts ids[2] = 2 from uniform logits: nll = log 3.
    logits[2] predicts ids[3] = 1 from [0, ln 2, 0], probabilities [1/4, 1/2, 1/4]: nll = log 2.
    logits[3] predicts nothing.
    """
    ids = torch.tensor([[0, 1, 2, 1]])
    logits = t([[[0.0, -9.0, 9.0], [0.0, 0.0, 0.0], [0.0, math.log(2), 0.0], [7.0, 7.0, 7.0]]], grad=True)
    mask = t([[0.0, 0.0, 1.0, 1.0]])
    return logits, ids, mask


def test_response_nll_counts_response_tokens_only_by_hand():
    logits, ids, mask = _example()
    loss = response_nll(logits, ids, mask)
    assert loss.item() == pytest.approx((math.log(3) + math.log(2)) / 2, abs=1e-12)  # 0.8958797
    loss.backward()
    assert logits.grad[0, 0].abs().sum() == 0 and logits.grad[0, 3].abs().sum() == 0  # prompt / last: no gradient
    # d/d logits[1] = (softmax - onehot(2)) / 2
    assert logits.grad[0, 1].tolist() == pytest.approx([1 / 6, 1 / 6, -1 / 3], abs=1e-12)


def test_response_nll_differs_when_the_prompt_counts():
    logits, ids, mask = _example()
    everything = response_nll(logits, ids, torch.ones_like(mask))
    assert everything.item() > 2.0  # the prompt token's large nll would dominate


def test_response_nll_normalizer_and_padding():
    logits, ids, mask = _example()
    assert response_nll(logits, ids, mask, normalizer=4.0).item() == pytest.approx((math.log(6)) / 4)
    # padding with NaN logits behind a zero mask changes nothing
    pad_logits = torch.cat([logits.detach(), torch.full((1, 2, 3), float("nan"), dtype=D)], dim=1)
    pad_ids = torch.cat([ids, torch.zeros(1, 2, dtype=torch.long)], dim=1)
    pad_mask = torch.cat([mask, torch.zeros(1, 2, dtype=D)], dim=1)
    assert response_nll(pad_logits, pad_ids, pad_mask).item() == pytest.approx(math.log(6) / 2)
    with pytest.raises(ValueError, match="no response token"):
        response_nll(logits, ids, torch.zeros_like(mask))

"""The micro-batch loss as a table of terms: the sum, its order and what each term reports."""
from types import SimpleNamespace

import pytest
import torch

from core import ppo
from core.kl import NO_KL, KLPenalty
from learner.config import PPOConfig
from learner.objectives.loss_terms import LOSS_TERMS, MicroBatch, TermSettings, micro_batch_loss
from learner.objectives.stats import UpdateStats

pytestmark = pytest.mark.unit

B, T = 3, 5


def _micro_batch(seed: int = 0) -> MicroBatch:
    g = torch.Generator().manual_seed(seed)
    rand = lambda: torch.randn(B, T, generator=g)  # noqa: E731
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    columns = SimpleNamespace(response_mask=mask, old_logprobs=rand() - 2, advantages=rand(), returns=rand(),
                              old_values=rand(), reference_logprobs=rand() - 2,
                              is_weights=torch.rand(B, T, generator=g) + 0.5)
    leaf = lambda t: t.clone().requires_grad_()  # noqa: E731
    return MicroBatch(logprobs=leaf(columns.old_logprobs + 0.1 * rand()), values=leaf(rand()),
                      entropy=leaf(rand().abs()), batch=columns,
                      agg=ppo.Aggregation(global_tokens=20.0, global_seqs=4.0))


def _inline(x: MicroBatch, s: TermSettings) -> torch.Tensor:
    """The loss as PPOObjective added its terms before the table: the order the table keeps."""
    b, p = x.batch, s.ppo
    loss = ppo.policy_loss(x.logprobs, b.old_logprobs, b.advantages, x.mask, p.clip_low, p.clip_high, p.dual_clip,
                           x.agg, weights=b.is_weights)[0]
    if s.critic:
        loss = loss + p.vf_coef * ppo.value_loss(x.values, b.old_values, b.returns, x.mask, p.value_clip, x.agg)[0]
    if s.kl.in_loss:
        loss = loss + s.kl.beta * ppo.kl_loss(x.logprobs, b.reference_logprobs, x.mask, s.kl.estimator, x.agg)[0]
    if p.entropy_coef:
        loss = loss - p.entropy_coef * ppo.aggregate_loss(x.entropy, x.mask, x.agg)
    return loss


def _grads(loss: torch.Tensor, x: MicroBatch) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, [x.logprobs, x.values, x.entropy], allow_unused=True,
                                    materialize_grads=True))


@pytest.mark.parametrize("settings", [
    TermSettings(ppo=PPOConfig(vf_coef=0.5, entropy_coef=0.01),
                 kl=KLPenalty(beta=0.2, estimator="k3", placement="loss"), critic=True),
    TermSettings(ppo=PPOConfig(dual_clip=3.0, clip_high=0.28), kl=NO_KL, critic=False),
    TermSettings(ppo=PPOConfig(entropy_coef=0.003), kl=KLPenalty(beta=0.0, estimator="k2", placement="loss"),
                 critic=False),
], ids=["every-term", "policy-alone", "kl-at-beta-0-and-entropy"])
def test_the_table_sums_as_the_inline_loss_did_to_the_bit(settings):
    x = _micro_batch()
    loss = micro_batch_loss(x, settings, UpdateStats(), tokens=13.0)
    expected = _inline(x, settings)
    assert torch.equal(loss, expected)
    assert all(torch.equal(a, b) for a, b in zip(_grads(loss, x), _grads(expected, x)))


def test_each_term_reports_its_value_before_the_weight():
    x, kl = _micro_batch(1), KLPenalty(beta=0.2, estimator="k3", placement="loss")
    stats = UpdateStats()
    micro_batch_loss(x, TermSettings(ppo=PPOConfig(), kl=kl, critic=True), stats, tokens=13.0)
    b = x.batch
    pg, clip, approx = ppo.policy_loss(x.logprobs, b.old_logprobs, b.advantages, x.mask, weights=b.is_weights,
                                       agg=x.agg)
    vf, vf_clip = ppo.value_loss(x.values, b.old_values, b.returns, x.mask, agg=x.agg)
    kl_value, kl_mean = ppo.kl_loss(x.logprobs, b.reference_logprobs, x.mask, "k3", x.agg)
    assert (stats.policy_loss, stats.clip_sum, stats.approx_kl_sum) == (pg.item(), clip.item() * 13, approx.item() * 13)
    assert (stats.value_loss, stats.vf_clip_sum) == (vf.item(), vf_clip.item() * 13)
    assert (stats.kl_loss, stats.kl_sum) == (kl_value.item(), kl_mean.item() * 13)
    off = UpdateStats()
    micro_batch_loss(x, TermSettings(ppo=PPOConfig(), kl=NO_KL, critic=False), off, tokens=13.0)
    assert (off.value_loss, off.vf_clip_sum, off.kl_loss, off.kl_sum) == (0.0, 0.0, 0.0, 0.0)


def test_the_terms_in_their_order():
    assert [t.name for t in LOSS_TERMS] == ["policy", "value", "kl", "entropy"]

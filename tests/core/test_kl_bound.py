"""k3 in the loss is clamped as verl's low_var_kl: one token's gradient stays bounded however far
the policy has moved from the reference (unclamped, exp(12) ~ 1.6e5 at log pi/ref = -12)."""
import math

import pytest
import torch

from core.kl import K3_GRAD_BOUND, K3_LIMIT, LOG_RATIO_LIMIT, bounded_kl, kl_estimate
from core.ppo import kl_loss

pytestmark = pytest.mark.unit

LOG_RATIOS = [-40.0, -25.0, -20.0, -12.0, -5.0, -2.7, -2.6, -1.0, -1e-3, 0.0, 1e-3, 1.0, 5.0, 11.0, 12.0, 20.0, 40.0]


def test_the_bound_is_where_k3_reaches_its_clamp():
    """k3(x) = e^x - x - 1 with x = log ref/pi; its gradient in log pi is 1 - e^x. The clamp
    k3 <= K3_LIMIT = 10 is reached at x* (e^x* = 11 + x*, x* ~ 2.6105), so |grad| <= e^x* - 1 = 10 + x*."""
    x = math.log(K3_LIMIT + 1 + 2.6)
    for _ in range(50):
        x = math.log(K3_LIMIT + 1 + x)
    assert K3_GRAD_BOUND == pytest.approx(K3_LIMIT + x, abs=1e-9) and 12.6 < K3_GRAD_BOUND < 12.62
    assert LOG_RATIO_LIMIT == 20.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_tokens_k3_gradient_is_bounded(dtype):
    ref = torch.full((1, len(LOG_RATIOS)), -3.0)
    logprobs = (ref + torch.tensor([LOG_RATIOS])).to(dtype).requires_grad_(True)
    mask = torch.ones_like(ref)
    loss, _ = kl_loss(logprobs, ref.to(dtype), mask, "k3")
    (loss * len(LOG_RATIOS)).backward()  # token-mean: undo the 1/N, so each entry is one token's gradient
    grad = logprobs.grad.float()[0]
    assert bool(torch.isfinite(grad).all()) and bool(torch.isfinite(loss))
    bound = float(torch.tensor(K3_GRAD_BOUND, dtype=torch.float64).to(dtype))  # bf16: the bound's rounding, 12.625
    assert float(grad.abs().max()) <= bound, list(zip(LOG_RATIOS, grad.tolist()))
    at = dict(zip(LOG_RATIOS, grad.tolist()))
    assert at[-12.0] == 0.0 and at[-25.0] == 0.0  # past the clamp: no pull from the KL at all
    for r in (-1.0, -1e-3, 0.0, 1.0, 5.0):  # inside it: exactly k3's gradient 1 - pi_ref/pi
        assert at[r] == pytest.approx(1 - math.exp(-r), rel=2e-2, abs=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_k3_is_clamped_to_its_limit_and_stays_non_negative(dtype):
    """The loss's k3 is bounded; the measured one (kl_estimate: metrics, the rollouts' kl) is not."""
    r = torch.tensor([LOG_RATIOS], dtype=dtype)
    k3 = bounded_kl(r, torch.zeros_like(r), "k3")
    assert k3.dtype == torch.float32 and float(k3.max()) <= K3_LIMIT and float(k3.min()) >= 0.0
    assert float(k3[0, LOG_RATIOS.index(-12.0)]) == K3_LIMIT
    assert float(kl_estimate(r, torch.zeros_like(r), "k3")[0, LOG_RATIOS.index(-12.0)]) > 1e5
    k2 = bounded_kl(r, torch.zeros_like(r), "k2")
    assert float(k2.max()) == 0.5 * LOG_RATIO_LIMIT ** 2

"""Truncated sampling (core.sampling): the kept set is vLLM's, the log-probs renormalise over it."""
import math

import pytest
import torch

from core import ppo
from core.sampling import kept_tokens, truncated_entropy, truncated_logprobs

pytestmark = pytest.mark.unit

COMBINATIONS = [(0, 0.9), (50, 1.0), (50, 0.9), (3, 0.5), (1, 1.0)]


@pytest.mark.parametrize("top_k, top_p", COMBINATIONS)
def test_kept_set_is_vllms(top_k, top_p):
    """On random logits, the tokens kept are exactly those vLLM's sampler leaves finite."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    torch.manual_seed(top_k + int(top_p * 10))
    logits = torch.randn(64, 512) * 3
    k = torch.full((64,), top_k) if top_k else None
    p = torch.full((64,), top_p) if top_p < 1 else None
    theirs = torch.isfinite(apply_top_k_top_p_pytorch(logits.clone(), k, p, allow_cpu_sync=True))
    ours = kept_tokens(logits, top_k, top_p)
    assert torch.equal(ours, theirs)
    assert 0 < int(ours.sum()) < ours.numel()  # the case truncates something


def test_hand_computed_nucleus():
    # probs 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps the two largest (0.5 + 0.3 >= 0.7);
    # running sums ascending are 0.05, 0.2, 0.5, 1.0 and those <= 0.3 (= 1 - p) are dropped.
    logits = torch.log(torch.tensor([[0.15, 0.5, 0.05, 0.3]]))
    assert kept_tokens(logits, 0, 0.7).tolist() == [[False, True, False, True]]
    assert kept_tokens(logits, 3, 1.0).tolist() == [[True, True, False, True]]
    assert kept_tokens(logits, 1, 1.0).tolist() == [[False, True, False, False]]
    # log-prob of token 3 renormalised over {1, 3}: log(0.3 / 0.8)
    lp = truncated_logprobs(logits[None], torch.tensor([[3]]), 0, 0.7)
    assert lp.item() == pytest.approx(math.log(0.3 / 0.8), abs=1e-6)
    # entropy over {1, 3}: -(5/8 log 5/8 + 3/8 log 3/8)
    h = truncated_entropy(logits[None], 0, 0.7)
    assert h.item() == pytest.approx(-(0.625 * math.log(0.625) + 0.375 * math.log(0.375)), abs=1e-6)


def test_token_outside_the_nucleus_stays_finite_with_a_gradient():
    """An updated learner (or the reference) may not keep the sampled token: it is counted in,
    so the log-prob is finite and the gradient defined."""
    logits = torch.log(torch.tensor([[[0.15, 0.5, 0.05, 0.3]]])).requires_grad_(True)
    lp = truncated_logprobs(logits, torch.tensor([[2]]), 0, 0.7)  # token 2 (p=0.05) is outside
    assert lp.item() == pytest.approx(math.log(0.05 / 0.85), abs=1e-6)
    lp.sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[0, 0, 0] == 0  # token 0 is outside the set and not scored: no gradient


def test_untruncated_is_the_plain_softmax():
    torch.manual_seed(0)
    logits, tokens = torch.randn(2, 5, 40), torch.randint(0, 40, (2, 5))
    plain = ppo.logprobs_from_logits(logits, tokens, 0.7)
    assert torch.allclose(truncated_logprobs(logits / 0.7, tokens, 0, 1.0), plain, atol=1e-6)
    assert torch.allclose(truncated_entropy(logits / 0.7), ppo.entropy_from_logits(logits, 0.7), atol=1e-5)


def test_truncation_moves_logprobs_and_entropy():
    """Through ppo: truncation renormalises (log-probs rise) and narrows (entropy falls)."""
    torch.manual_seed(1)
    logits = torch.randn(2, 5, 40) * 2
    tokens = logits.argmax(-1)  # the most likely token is always kept
    full = ppo.logprobs_from_logits(logits, tokens, 1.0)
    cut = ppo.logprobs_from_logits(logits, tokens, 1.0, top_k=5, top_p=0.9)
    assert (cut > full + 1e-4).all()
    assert (ppo.entropy_from_logits(logits, top_k=5, top_p=0.9) < ppo.entropy_from_logits(logits)).all()


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_k=-1), "top_k must be an int >= 0"),
    (dict(top_p=0.0), "top_p must be in (0, 1]"),
    (dict(top_p=1.5), "top_p must be in (0, 1]"),
])
def test_bad_truncation_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("]", r"\]")):
        ppo.logprobs_from_logits(torch.zeros(1, 1, 4), torch.zeros(1, 1, dtype=torch.long), **kwargs)

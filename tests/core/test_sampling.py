"""Truncated sampling (core.sampling): the kept set is vLLM's, the log-probs renormalise over it."""
import math

import pytest
import torch

from core import ppo
from core.logprobs import entropy_from_logits, logprobs_from_logits
from core.sampling import kept_entropy, kept_logprobs, kept_tokens, truncated_entropy, truncated_logprobs

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


@pytest.mark.parametrize("top_k, top_p", [(20, 1.0), (20, 0.95), (5, 0.8)])
def test_ties_at_the_kth_logit_are_kept_as_vllm_keeps_them(top_k, top_p):
    """bf16 logits tie: every token equal to the k-th largest stays, in vLLM's top-k-only
    path and its sorting top-k/top-p path alike (both on the float32 cast, as its sampler)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_only, apply_top_k_top_p_pytorch

    torch.manual_seed(top_k)
    logits = (torch.randn(64, 1024) * 3).bfloat16().float()
    k = torch.full((64,), top_k)
    p = torch.full((64,), top_p) if top_p < 1 else None
    theirs = apply_top_k_only(logits.clone(), k.clone()) if p is None else \
        apply_top_k_top_p_pytorch(logits.clone(), k, p)
    ours = kept_tokens(logits, top_k, top_p)
    assert torch.equal(ours, torch.isfinite(theirs))
    assert torch.equal(kept_tokens(logits.view(8, 8, -1), top_k, top_p).view(64, -1), ours)  # [B, T, V] alike
    if p is None:
        assert int(ours.sum(-1).max()) > top_k  # some row tied at the k-th logit


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


def test_token_outside_its_own_nucleus_has_no_probability():
    """truncated_logprobs is the policy's own truncated distribution: a token its sampler
    would drop has log-prob -inf (the proximal side of the off-policy weight)."""
    logits = torch.log(torch.tensor([[[0.15, 0.5, 0.05, 0.3]]]))
    assert truncated_logprobs(logits, torch.tensor([[2]]), 0, 0.7).item() == float("-inf")


def test_kept_set_scoring_by_hand_with_a_gradient():
    """Renormalised over the sampler's set {1, 2, 3} whatever these logits would keep: token 2
    lies outside their own nucleus ({1, 3} at top_p 0.7) yet is scored finitely, with a
    gradient on the kept logits only. A padding position (no kept id) stays finite."""
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    logits = torch.log(probs).repeat(1, 2, 1).requires_grad_(True)
    kept = torch.tensor([[[1, 3, 2], [-1, -1, -1]]])
    tokens = torch.tensor([[2, 0]])
    lp = kept_logprobs(logits, tokens, kept)
    assert lp[0, 0].item() == pytest.approx(math.log(0.05 / 0.85), abs=1e-6)
    assert lp[0, 1].item() == pytest.approx(0.0, abs=1e-6)  # padding: the token alone
    h = kept_entropy(logits, tokens, kept)
    q = probs[[1, 3, 2]] / 0.85
    assert h[0, 0].item() == pytest.approx(float(-(q * q.log()).sum()), abs=1e-6)
    (lp[0, 0] + h.sum()).backward()  # the -inf entries of a kept set must not turn gradients NaN
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 0, 0] == 0


def _truncated_kl_case(scale: float, top_k: int, top_p: float, vocab: int = 2000):
    """Reference logits z; behaviour (policy) logits scale * z. Returns the behaviour's kept set
    S [V] bool, its truncated distribution p^S [V], the reference's log q^S [V] renormalised on
    S, and what today's estimator gives per token (k1 from kept_logprobs) [V]."""
    torch.manual_seed(7)
    ref = torch.randn(vocab) * 2.0
    pol = scale * ref
    keep = kept_tokens(pol[None], top_k, top_p)[0]
    ids = keep.nonzero().flatten()
    p = torch.where(keep, torch.softmax(pol.masked_fill(~keep, float("-inf")), -1), 0.0).double()
    log_q_on_s = (ref - torch.logsumexp(ref[ids], -1)).double()
    tokens = torch.arange(vocab)[None]
    kept_ids = ids.expand(vocab, -1)[None]
    k1 = (kept_logprobs(pol.expand(1, vocab, -1), tokens, kept_ids)
          - kept_logprobs(ref.expand(1, vocab, -1), tokens, kept_ids))[0].double()
    return keep, p, log_q_on_s, k1


@pytest.mark.parametrize("scale", [0.9, 1.1])  # a flatter and a sharper policy than the reference
@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (50, 1.0), (50, 0.9)])
def test_k1_penalty_expectation_is_the_truncated_kl(scale, top_k, top_p):
    """The per-token k1 penalty, scored over the sampler's kept set on both sides, has as its
    expectation under the sampler the KL between the truncated behaviour distribution and the
    reference renormalised over the same set: computed by hand over the vocabulary, > 0, and
    matched by the mean over 200k sampled tokens. Scoring the reference over its own nucleus
    with the sampled token forced in (the old scheme) is off by far more than that."""
    keep, p, log_q_on_s, k1 = _truncated_kl_case(scale, top_k, top_p)
    log_p = torch.where(keep, p.clamp_min(1e-300).log(), 0.0)
    exact = float((p * torch.where(keep, log_p - log_q_on_s, 0.0)).sum())
    expected_k1 = float((p * torch.where(keep, k1, 0.0)).sum())
    assert exact > 1e-3
    assert expected_k1 == pytest.approx(exact, rel=1e-4)

    gen = torch.Generator().manual_seed(0)
    draws = torch.multinomial(p.float(), 200_000, replacement=True, generator=gen)
    sample = k1[draws]
    stderr = float(sample.std()) / math.sqrt(sample.numel())
    assert abs(float(sample.mean()) - exact) < 4 * stderr

    torch.manual_seed(7)
    ref = torch.randn(p.numel()) * 2.0
    own = kept_tokens(ref[None], top_k, top_p)[0]
    forced = own[None].repeat(p.numel(), 1) | torch.eye(p.numel(), dtype=torch.bool)
    old_ref = ref - torch.logsumexp(ref.masked_fill(~forced, float("-inf")), -1)
    old_k1 = torch.where(keep, log_p - old_ref.double(), 0.0)
    old = float((p * old_k1).sum())
    print(f"scale {scale} top_k {top_k} top_p {top_p}: KL {exact:.4f}, k1 mean {expected_k1:.4f}, old {old:.4f}")
    if not torch.equal(own, keep):  # a scaled policy keeps the reference's top-k set: same sets
        assert abs(old - exact) > 0.005


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (50, 0.9)])
def test_k1_penalty_is_zero_when_policy_is_reference(top_k, top_p):
    keep, p, _, k1 = _truncated_kl_case(1.0, top_k, top_p)
    assert float(torch.where(keep, k1, 0.0).abs().max()) < 1e-5


@pytest.mark.parametrize("scale", [0.9, 1.1])
def test_off_policy_weight_is_zero_outside_the_proximal_set(scale):
    """Behaviour = the sampler's truncated distribution; proximal = another policy's own
    truncated one. A sampled token the proximal policy would not keep has weight exactly 0,
    and the weights' mean under the sampler is the proximal mass on the sampler's set (<= 1)."""
    torch.manual_seed(3)
    prox_logits = torch.randn(1, 1, 500) * 2.0
    beh_logits = scale * prox_logits + 0.3 * torch.randn(1, 1, 500)
    keep_b = kept_tokens(beh_logits[0], 0, 0.9)[0]
    ids = keep_b.nonzero().flatten()
    tokens = ids[None]                                   # every token the sampler may draw
    behaviour = kept_logprobs(beh_logits.expand(1, ids.numel(), -1), tokens, ids.expand(ids.numel(), -1)[None])
    proximal = logprobs_from_logits(prox_logits.expand(1, ids.numel(), -1), tokens, top_p=0.9)
    w, _ = ppo.behaviour_weights(proximal, behaviour, torch.ones_like(behaviour), "tis", cap=1e6)
    outside = ~kept_tokens(prox_logits[0], 0, 0.9)[0][ids]
    assert (w[0][outside] == 0).all()
    assert outside.any() or scale > 1  # a sharper sampler keeps a subset of a flatter nucleus
    mean_under_sampler = float((behaviour.exp() * w).sum())
    prox_mass_on_s = float(proximal.exp().sum())
    assert mean_under_sampler == pytest.approx(prox_mass_on_s, rel=1e-4) and mean_under_sampler <= 1 + 1e-6


def test_untruncated_is_the_plain_softmax():
    torch.manual_seed(0)
    logits, tokens = torch.randn(2, 5, 40), torch.randint(0, 40, (2, 5))
    plain = logprobs_from_logits(logits, tokens, 0.7)
    assert torch.allclose(truncated_logprobs(logits / 0.7, tokens, 0, 1.0), plain, atol=1e-6)
    assert torch.allclose(truncated_entropy(logits / 0.7), entropy_from_logits(logits, 0.7), atol=1e-5)


def test_truncation_moves_logprobs_and_entropy():
    """Through ppo: truncation renormalises (log-probs rise) and narrows (entropy falls)."""
    torch.manual_seed(1)
    logits = torch.randn(2, 5, 40) * 2
    tokens = logits.argmax(-1)  # the most likely token is always kept
    full = logprobs_from_logits(logits, tokens, 1.0)
    cut = logprobs_from_logits(logits, tokens, 1.0, top_k=5, top_p=0.9)
    assert (cut > full + 1e-4).all()
    assert (entropy_from_logits(logits, top_k=5, top_p=0.9) < entropy_from_logits(logits)).all()


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_k=-1), "top_k must be an int >= 0"),
    (dict(top_p=0.0), "top_p must be in (0, 1]"),
    (dict(top_p=1.5), "top_p must be in (0, 1]"),
])
def test_bad_truncation_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("]", r"\]")):
        logprobs_from_logits(torch.zeros(1, 1, 4), torch.zeros(1, 1, dtype=torch.long), **kwargs)

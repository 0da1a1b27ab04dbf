"""The ragged workload's stopping policy (bench/stopping_policy.py), made from the bench's own
policy: EOS at the set mean probability after every token, early in a sequence as late, on
sequences it was not set on too, and the pad token never. Nothing timed."""
import pytest
import torch

from bench.stopping_policy import add_stop_feature

pytestmark = pytest.mark.unit

HAZARD = 1 / 64


def next_token_probs(model, ids):
    with torch.no_grad():
        return torch.softmax(model(input_ids=ids).logits.float(), -1)  # [B, T, V]


def test_eos_comes_at_the_set_rate_everywhere_and_pad_never():
    from transformers import AutoModelForCausalLM

    from cluster.demo.tiny_models import SPEC_BENCH_32M, build_policy
    model = AutoModelForCausalLM.from_pretrained(build_policy(SPEC_BENCH_32M), dtype=torch.float32).eval()
    eos, pad, vocab = model.config.eos_token_id, model.config.pad_token_id, model.config.vocab_size
    rng = torch.Generator().manual_seed(0)
    probe, fresh = (torch.randint(max(eos, pad) + 1, vocab, (8, 48), generator=rng) for _ in range(2))
    before = next_token_probs(model, fresh)[..., eos].mean()
    got = add_stop_feature(model, eos=eos, pad=pad, hazard=HAZARD, probe_ids=probe)
    assert got == pytest.approx(HAZARD, rel=1e-3)
    p = next_token_probs(model, fresh)
    print(f"P(eos) {float(before):.2e} -> {float(p[..., eos].mean()):.4f} on fresh sequences")
    assert float(p[..., eos].mean()) == pytest.approx(HAZARD, rel=0.3)  # the set rate, not the probe's alone
    assert float(p[:, :8, eos].mean()) == pytest.approx(float(p[:, -8:, eos].mean()), rel=0.5)  # early as late
    assert float(p[..., pad].max()) < 1e-9

"""Varlen attention (core/modeling/varlen_attention.py): per-sequence attention of a packed row equals
the block-diagonal masked attention (sliding windows, grouped KV heads, runs of equal lengths),
and a policy on it gives the padded forward's log-probs, values, entropy and gradients, with no
sequence seeing another and no mask built (fp32, tiny policy)."""
import dataclasses
import types

import pytest
import torch
from test_packing import PROMPTS, RESPONSES, TOL, both, gap, models, ragged_batch

from core.modeling.varlen_attention import VARLEN, runs, use_varlen, varlen_attention_forward
from learner.packing import pack
from learner.policy import PolicyWithValueHead, body_of

LENGTHS = [5, 3, 3, 3, 0, 12, 1, 7, 7]  # a run of three 3s, an empty sequence, a lone token


def dense(q, k, v, lengths, *, window=None, causal=True, scale=None):
    """The reference: sdpa over the whole row with the block-diagonal (banded) mask."""
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    i = torch.arange(len(seq))
    mask = seq[:, None] == seq[None, :]
    if causal:
        mask &= i[None, :] <= i[:, None]
    if window is not None:
        mask &= i[None, :] > i[:, None] - window
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


@pytest.mark.unit
@pytest.mark.parametrize("window, causal, kv_heads", [(None, True, 4), (4, True, 2), (100, True, 1), (None, False, 4)])
def test_per_sequence_attention_is_the_block_diagonal_masked_attention(window, causal, kv_heads):
    torch.manual_seed(0)
    T, H, D = sum(LENGTHS), 4, 8
    q, k, v = torch.randn(1, H, T, D), torch.randn(1, kv_heads, T, D), torch.randn(1, kv_heads, T, D)
    module = types.SimpleNamespace(is_causal=causal, num_key_value_groups=H // kv_heads)
    cu = torch.tensor([0, *LENGTHS]).cumsum(0)
    out, weights = varlen_attention_forward(module, q, k, v, None, scaling=0.3, sliding_window=window,
                                            cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert weights is None and out.shape == (1, T, H, D)
    expected = dense(q, k, v, LENGTHS, window=window, causal=causal, scale=0.3)
    assert float((out - expected).abs().max()) < 1e-6
    if window == 4:  # the window bites: plain causal attention differs
        assert float((out - dense(q, k, v, LENGTHS, scale=0.3)).abs().max()) > 1e-2


@pytest.mark.unit
def test_without_offsets_or_mask_each_row_is_one_sequence():
    """An unpadded batch (transformers skips an all-ones mask): causal within each row, windowed."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, 20, 8), torch.randn(3, 2, 20, 8), torch.randn(3, 2, 20, 8)
    module = types.SimpleNamespace(num_key_value_groups=2)
    for window in (None, 6):
        out, _ = varlen_attention_forward(module, q, k, v, None, sliding_window=window)
        expected = torch.cat([dense(q[i:i + 1], k[i:i + 1], v[i:i + 1], [20], window=window) for i in range(3)])
        assert float((out - expected).abs().max()) < 1e-6


@pytest.mark.unit
def test_sequences_run_in_runs_of_one_length_and_bad_offsets_are_refused():
    assert runs(torch.tensor([0, *LENGTHS]).cumsum(0)) == [(0, 1, 5), (5, 3, 3), (14, 1, 12), (26, 1, 1), (27, 2, 7)]
    q = torch.randn(1, 2, 10, 4)
    module = types.SimpleNamespace()
    with pytest.raises(ValueError, match="ends at 9, the row has 10 tokens"):
        varlen_attention_forward(module, q, q, q, None, cu_seq_lens_q=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="soft-capping"):
        varlen_attention_forward(module, q, q, q, None, softcap=2.0, cu_seq_lens_q=torch.tensor([0, 10]))
    with pytest.raises(ValueError, match="no KV cache"):
        varlen_attention_forward(module, q[:, :, :1], q, q, None)
    with pytest.raises(ValueError, match="one packed row"):
        varlen_attention_forward(module, q.expand(2, -1, -1, -1), q, q, None, cu_seq_lens_q=torch.tensor([0, 10]))


def varlen_models(policy_path, reward_path):
    out = models(policy_path, reward_path)
    for model in out.values():
        assert set(model.use_varlen().values()) == {VARLEN}
    return out


@pytest.mark.unit
def test_a_policy_on_varlen_attention_gives_the_padded_outputs(policy_path, reward_path, pad_id):
    b = ragged_batch(pad_id)
    m = b.response_mask
    for critic, model in varlen_models(policy_path, reward_path).items():
        for kw in (dict(temperature=0.7, top_k=20, with_own_set=True), dict(values_only=True)):
            padded, packed = both(model, b, **kw)
            for x, y in zip(padded, packed):
                if x is not None:
                    assert gap(x, y, m) < TOL, (critic, kw)


@pytest.mark.unit
def test_varlen_attention_gets_the_offsets_and_no_mask(policy_path, pad_id):
    """The packed forward's attention calls carry the row's offsets and no mask (none was
    built); the padded forward of the same model still gets its padding mask."""
    model = PolicyWithValueHead.from_pretrained(policy_path, critic="none").eval()
    model.use_varlen()
    seen = []
    attention = body_of(model.lm).layers[0].self_attn
    hook = attention.register_forward_pre_hook(lambda _m, _a, kw: seen.append(kw), with_kwargs=True)
    b = ragged_batch(pad_id)
    try:
        both(model, b)
    finally:
        hook.remove()
    padded, packed = seen
    assert padded["attention_mask"] is not None and "cu_seq_lens_q" not in padded
    assert packed["attention_mask"] is None
    lengths = [a + r for a, r in zip(PROMPTS, RESPONSES)]
    assert packed["cu_seq_lens_q"].tolist() == torch.tensor([0, *lengths]).cumsum(0).tolist()


@pytest.mark.unit
def test_varlen_packed_sequences_do_not_attend_to_each_other(policy_path, pad_id):
    model = PolicyWithValueHead.from_pretrained(policy_path).eval()
    model.use_varlen()
    torch.nn.init.normal_(model.value_head.weight, std=0.1)
    b = ragged_batch(pad_id)
    changed = b.input_ids.clone()
    changed[2, b.attention_mask[2].bool()] = torch.randint(2, 1024, (PROMPTS[2] + RESPONSES[2],))
    p, p2 = pack(b), pack(dataclasses.replace(b, input_ids=changed))
    with torch.no_grad():
        before = model(p.input_ids, None, p.position_ids, packed=p)
        after = model(p2.input_ids, None, p2.position_ids, packed=p2)
    assert not torch.equal(before[0][2], after[0][2])
    others = [0, 1, 3, 4, 5]
    assert all(torch.equal(x[others], y[others]) for x, y in zip(before, after))


@pytest.mark.unit
def test_varlen_gradients_are_the_padded_ones_under_gradient_checkpointing(policy_path, pad_id):
    """The recompute of a checkpointed layer takes the path its forward took (the dispatch
    reads the call's arguments, not a switch that could have moved since)."""
    b = ragged_batch(pad_id)
    m = b.response_mask
    grads = []
    for packed in (False, True):
        torch.manual_seed(0)
        model = PolicyWithValueHead.from_pretrained(policy_path)
        torch.nn.init.normal_(model.value_head.weight, std=0.1)
        model.lm.gradient_checkpointing_enable()
        model.train()
        if packed:
            model.use_varlen()
            p = pack(b)
            lp, v, ent = model(p.input_ids, None, p.position_ids, packed=p)
        else:
            lp, v, ent = model(b.input_ids, b.attention_mask, b.position_ids, prompt_len=b.prompt_len)
        ((lp * m).sum() + (v * m).pow(2).sum() + (ent * m).sum()).backward()
        grads.append({n: q.grad for n, q in model.named_parameters() if q.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    # Relative to each gradient's scale (sums over ~100 tokens: the masked packed path is ~1e-6 off too).
    assert max(float((grads[0][n] - grads[1][n]).abs().max() / grads[0][n].abs().max()) for n in grads[0]) < TOL


@pytest.mark.unit
def test_a_model_off_sdpa_keeps_its_attention(policy_path):
    from transformers import AutoModelForCausalLM
    lm = AutoModelForCausalLM.from_pretrained(policy_path, attn_implementation="eager")
    assert use_varlen(lm) == "eager" == lm.config._attn_implementation

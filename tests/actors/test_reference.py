import logging
import shutil

import numpy as np
import pytest
import torch

from actors.reference import Reference


@pytest.fixture(scope="module")
def hf_model(policy_path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(policy_path).eval()


def _batch(seed=0, prompt_lens=(3, 9, 5, 1, 6), response_lens=(4, 2, 7, 3, 0)):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(2, 1024, size=k) for k in prompt_lens]
    responses = [rng.integers(2, 1024, size=k) for k in response_lens]
    return prompts, responses


def _direct(model, prompt, response, temperature):
    """The textbook computation: one unpadded sequence, log_softmax(logits / T), gather."""
    ids = torch.tensor(np.concatenate([prompt, response]))[None]
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    P = len(prompt)
    lp = torch.log_softmax(logits[P - 1:-1] / temperature, dim=-1)
    return lp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1).numpy()


@pytest.mark.integration
@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_direct_hf_computation(policy_path, hf_model, temperature, packing):
    """Packed (the chunk as one row of real tokens) or padded, each sequence scores as alone."""
    ref = Reference(model=policy_path, temperature=temperature, batch_size=16, packing=packing)
    prompts, responses = _batch()
    got = ref.logprobs(prompts, responses)
    assert [g.shape for g in got] == [(len(r),) for r in responses]
    assert all(g.dtype == np.float32 for g in got)
    for p, r, g in zip(prompts, responses, got):
        if len(r):
            np.testing.assert_allclose(g, _direct(hf_model, p, r, temperature), atol=1e-5, rtol=0)
    if temperature != 1.0:  # the temperature must actually change the numbers
        plain = Reference(model=policy_path, temperature=1.0).logprobs(prompts, responses)
        assert not np.allclose(got[0], plain[0], atol=1e-3)


@pytest.mark.integration
@pytest.mark.parametrize("packing", [True, False])
def test_batch_equals_one_by_one(policy_path, packing):
    # batch_size 2 over 5 items of mixed length exercises chunking and order restoration.
    ref = Reference(model=policy_path, batch_size=2, packing=packing)
    prompts, responses = _batch(seed=1)
    batched = ref.logprobs(prompts, responses)
    for p, r, b in zip(prompts, responses, batched):
        single = ref.logprobs([p], [r])[0]
        assert single.shape == b.shape
        if len(r):
            assert np.abs(single - b).max() < 1e-5


@pytest.mark.integration
def test_unchanged_by_training_a_policy_loaded_from_same_path(policy_path):
    from transformers import AutoModelForCausalLM

    ref = Reference(model=policy_path)
    prompts, responses = _batch(seed=2)
    before = ref.logprobs(prompts, responses)

    policy = AutoModelForCausalLM.from_pretrained(policy_path)
    policy.train()
    opt = torch.optim.SGD(policy.parameters(), lr=1.0)
    ids = torch.tensor(np.concatenate([prompts[0], responses[0]]))[None]
    for _ in range(3):
        loss = policy(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    fresh = AutoModelForCausalLM.from_pretrained(policy_path)
    changed = [not torch.equal(a, b) for a, b in zip(policy.parameters(), fresh.parameters())]
    assert sum(changed) > len(changed) // 2, "training did not move the policy; the test proves nothing"

    after = ref.logprobs(prompts, responses)
    for a, b in zip(before, after):
        assert np.array_equal(a, b)
    ref_ptrs = {p.data_ptr() for p in ref.model.parameters()}
    assert not ref_ptrs & {p.data_ptr() for p in policy.parameters()}
    assert not any(p.requires_grad for p in ref.model.parameters())
    assert not ref.model.training


@pytest.mark.integration
def test_tokenizer_without_pad_falls_back_to_eos(policy_path, tmp_path, caplog):
    from transformers import AutoTokenizer

    path = tmp_path / "nopad"
    shutil.copytree(policy_path, path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.pad_token = None
    tok.save_pretrained(path)
    with caplog.at_level(logging.WARNING, logger="actors.reference"):
        ref = Reference(model=str(path))
    assert ref.pad_id == tok.eos_token_id
    assert "no pad token" in caplog.text and "eos" in caplog.text
    prompts, responses = _batch(seed=3)
    batched = ref.logprobs(prompts, responses)
    for p, r, b in zip(prompts, responses, batched):
        if len(r):
            assert np.abs(ref.logprobs([p], [r])[0] - b).max() < 1e-5


@pytest.mark.integration
def test_bad_inputs(policy_path, tmp_path):
    missing = tmp_path / "does-not-exist"
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        Reference(model=str(missing))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty.*not a Hugging Face model directory"):
        Reference(model=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="temperature"):
        Reference(model=policy_path, temperature=0.0)
    with pytest.raises(ValueError, match="dtype"):
        Reference(model=policy_path, dtype="float8")
    ref = Reference(model=policy_path)
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        ref.logprobs([np.array([1, 2]), np.array([3])], [np.array([4])])
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        ref.logprobs([np.array([], dtype=np.int64)], [np.array([4])])
    assert ref.logprobs([], []) == []
    h = ref.health()
    assert h["role"] == "reference" and h["ok"] and h["model"] == policy_path


@pytest.mark.integration
@pytest.mark.slow  # the default tier: tests/e2e/test_train.py::test_sync_default_learns scores with reference actors
def test_runs_unchanged_as_ray_actor(policy_path, ray_cluster):
    ray = ray_cluster
    actor = ray.remote(Reference).remote(model=policy_path, temperature=0.7)
    prompts, responses = _batch(seed=4)
    remote = ray.get(actor.logprobs.remote(prompts, responses))
    local = Reference(model=policy_path, temperature=0.7).logprobs(prompts, responses)
    for a, b in zip(remote, local):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert ray.get(actor.health.remote())["sequences"] == len(prompts)


@pytest.mark.integration
def test_packed_and_padded_agree_over_truncated_kept_sets(policy_path):
    """With top-k sampling each token renormalises over its own kept set; packing moves the
    sets with their tokens (kept sets of different widths per rollout, an empty response)."""
    prompts, responses = _batch(seed=2)
    rng = np.random.default_rng(3)
    kept = []
    for i, r in enumerate(responses):
        k = rng.integers(2, 1024, size=(r.size, 3 + i))
        k[:, 0] = r  # the sampled token is always in its set
        k[:, -1] = -1  # padding inside a set
        kept.append(k)
    packed, padded = (Reference(model=policy_path, top_k=20, batch_size=3, packing=p).logprobs(
        prompts, responses, kept) for p in (True, False))
    for a, b, r in zip(packed, padded, responses):
        assert a.shape == b.shape == (r.size,)
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    assert all((a <= 0).all() and (a >= -np.log(8)).all() for a in packed if a.size)  # over sets of <= 8

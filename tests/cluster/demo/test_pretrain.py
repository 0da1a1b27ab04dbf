import json
import time

import pytest
import torch

from cluster.demo.pretrain import build_pretrained_policy, corpus_loss, ptx_batches
from cluster.demo.tiny_models import TinySpec, build_policy, build_tokenizer


@pytest.mark.unit
def test_ptx_batches_layout_and_reproducibility():
    from transformers import AutoTokenizer

    path = build_tokenizer()
    tok = AutoTokenizer.from_pretrained(path)
    stream = ptx_batches(path, batch_size=6, seq_len=24, seed=7)
    ids, mask = next(stream)
    assert ids.shape == mask.shape == (6, 24) and ids.dtype == mask.dtype == torch.long
    for row, m in zip(ids, mask):
        n = int(m.sum())
        assert m[:n].all() and not m[n:].any()  # real tokens first, then padding
        assert row[n - 1] == tok.eos_token_id and (row[n:] == tok.pad_token_id).all()
        assert tok.decode(row[: n - 1]).endswith(".")
    again = next(ptx_batches(path, batch_size=6, seq_len=24, seed=7))
    assert torch.equal(again[0], ids) and torch.equal(again[1], mask)
    assert not torch.equal(next(ptx_batches(path, batch_size=6, seq_len=24, seed=8))[0], ids)
    cut, cut_mask = next(ptx_batches(path, batch_size=64, seq_len=4, seed=0))
    assert cut_mask.all()  # every sentence is longer than 4 tokens: rows are cut, never padded
    batches = [next(stream) for _ in range(400)]  # > one pass over the 2000 sentences: it wraps around
    assert all(b[0].shape == (6, 24) for b in batches)


@pytest.mark.integration
def test_cache_key_and_reuse(tmp_path, monkeypatch):
    monkeypatch.setenv("TETHER_CACHE", str(tmp_path))
    spec = TinySpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1, vocab_size=1024)
    t0 = time.perf_counter()
    a = build_pretrained_policy(spec, steps=3, batch_size=4)
    built = time.perf_counter() - t0  # tokenizer, base and pre-training, into an empty cache
    stats = json.loads((a / "pretrain.json").read_text())
    assert stats["steps"] == 3 and len(stats["loss_curve"]) == 3
    files = files_of(a)
    t0 = time.perf_counter()
    assert build_pretrained_policy(spec, steps=3, batch_size=4) == a
    hit = time.perf_counter() - t0
    assert files_of(a) == files, "a cache hit rewrote the model"  # found, not built again
    assert hit < built / 10, (hit, built)
    assert build_pretrained_policy(spec, steps=4, batch_size=4) != a
    assert build_pretrained_policy(spec, steps=3, batch_size=4, lr=1e-3) != a
    assert build_pretrained_policy(spec, steps=3, batch_size=4, seed=1) != a
    assert a.parent == tmp_path and a != build_policy(spec)
    with pytest.raises(ValueError):
        build_pretrained_policy(spec, steps=0)


@pytest.fixture(scope="module")
def pretrained():
    return build_pretrained_policy()  # the default, shared with the demo; built once per cache


@pytest.mark.integration
def test_default_is_cached(pretrained):
    files = files_of(pretrained)
    assert build_pretrained_policy() == pretrained
    assert files_of(pretrained) == files, "a cache hit rewrote the model"  # found, not built again


def files_of(folder) -> dict:
    """Each file of a model folder: its inode and modification time (a build writes new files)."""
    return {p.relative_to(folder): (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.rglob("*")}


@pytest.mark.integration
def test_pretraining_lowers_corpus_loss(pretrained):
    trained = corpus_loss(pretrained, n_batches=4)
    random_init = corpus_loss(build_policy(), n_batches=4)
    assert random_init > 6.0  # ~ln(1024): uniform over the vocabulary
    assert trained < 2.2 < random_init - 3.5


@pytest.mark.integration
def test_pretrained_policy_ends_sentences_with_eos(pretrained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cluster.demo.sentiment import builtin_prompts

    tok = AutoTokenizer.from_pretrained(pretrained)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(pretrained).eval()
    prompts = builtin_prompts()[::10]
    enc = tok(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=16,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    new = out[:, enc["input_ids"].shape[1]:].tolist()
    ended = [tok.eos_token_id in row for row in new]
    assert sum(ended) >= 0.9 * len(prompts)
    texts = [tok.decode(row[: row.index(tok.eos_token_id)]) for row in new if tok.eos_token_id in row]
    assert sum(t.endswith(".") for t in texts) >= 0.9 * len(texts)


@pytest.mark.unit
def test_default_cache_key_is_unchanged_by_other_corpora():
    """The sentiment policy's key is the one caches were built under before texts= existed;
    another corpus, or the same corpus changed, gets a key of its own."""
    from cluster.demo.pretrain import DEFAULT_BATCH_SIZE, DEFAULT_LR, DEFAULT_STEPS, pretrained_key

    default = pretrained_key(TinySpec(), DEFAULT_STEPS, DEFAULT_BATCH_SIZE, DEFAULT_LR, 0)
    assert default == "af7bbfce9201bd47"
    other = pretrained_key(TinySpec(), DEFAULT_STEPS, DEFAULT_BATCH_SIZE, DEFAULT_LR, 0, ["1 plus 1 is 2."])
    assert other != default
    assert pretrained_key(TinySpec(), DEFAULT_STEPS, DEFAULT_BATCH_SIZE, DEFAULT_LR, 0, ["1 plus 1 is 3."]) != other

import json
import sys

import numpy as np
import pytest

from cluster.data.prompts import PromptDataset
from cluster.demo.sentiment import builtin_prompts
from cluster.demo.tiny_models import build_tokenizer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tok_path():
    return str(build_tokenizer())


def _load(path, tok_path, **kw):
    return PromptDataset.load(path=str(path) if path is not None else None, tokenizer_path=tok_path, **kw)


def _one_line(exc_info):
    msg = str(exc_info.value)
    assert "\n" not in msg and msg
    return msg


@pytest.fixture
def messy_jsonl(tmp_path):
    lines = [
        json.dumps({"prompt": "The cat was"}),          # 1 good
        json.dumps({"text": "no prompt here"}),         # 2 missing field
        json.dumps({"prompt": 42}),                     # 3 not a string
        "{not json at all",                             # 4 malformed
        "",                                             # 5 blank: ignored, not counted
        json.dumps({"prompt": "   "}),                  # 6 empty
        json.dumps(["a", "list"]),                      # 7 not an object
        json.dumps({"prompt": None}),                   # 8 not a string
        json.dumps({"prompt": "My friend felt", "x": 1}),  # 9 good
        json.dumps({"prompt": "A dog seemed"}),         # 10 good
    ]
    p = tmp_path / "prompts.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_jsonl_skips_are_counted_with_reasons(messy_jsonl, tok_path):
    ds = _load(messy_jsonl, tok_path)
    assert ds.texts == ["The cat was", "My friend felt", "A dog seemed"]
    assert len(ds) == 3 and ds.ids.tolist() == [0, 1, 2]
    assert ds.skip_counts == {"missing_field": 1, "not_a_string": 2, "malformed_json": 1,
                              "empty": 1, "not_an_object": 1}
    assert ds.num_skipped == 6 and len(ds.skipped) == 6
    reasons = " | ".join(ds.skipped)
    assert "line 4: malformed JSON" in reasons
    assert "line 2: missing field 'prompt'" in reasons
    assert "line 3: field 'prompt' is int" in reasons
    assert "line 8: field 'prompt' is NoneType" in reasons
    assert "line 6: field 'prompt' is empty" in reasons
    assert "line 7: not a JSON object" in reasons
    for ids in ds.prompt_ids:
        assert isinstance(ids, np.ndarray) and ids.dtype == np.int64 and ids.size > 0


def test_prompt_ids_match_the_tokenizer(messy_jsonl, tok_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_path)
    ds = _load(messy_jsonl, tok_path)
    for text, ids in zip(ds.texts, ds.prompt_ids):
        assert ids.tolist() == tok(text)["input_ids"]


def test_other_field_and_too_long_prompts(tmp_path, tok_path):
    p = tmp_path / "q.jsonl"
    p.write_text("\n".join(json.dumps({"question": q}) for q in
                           ["The cat was", "The cat was happy in the park and the dog seemed", "A bird felt"]))
    ds = _load(p, tok_path, field="question", max_prompt_tokens=4)
    assert ds.texts == ["The cat was", "A bird felt"]
    assert ds.skip_counts == {"too_long": 1}
    assert "line 2:" in ds.skipped[0] and "data.max_prompt_tokens=4" in ds.skipped[0]


def test_builtin_prompts(tok_path):
    prompts = builtin_prompts()
    assert prompts == builtin_prompts() and len(prompts) == 320 == len(set(prompts))
    assert prompts[0] == "The cat was" and all(p[0].isupper() for p in prompts)
    assert all(not p.endswith(".") and len(p.split()) <= 14 for p in prompts)
    assert builtin_prompts(10) == prompts[:10]
    ds = _load(None, tok_path)
    assert ds.texts == prompts and ds.num_skipped == 0 and ds.source == "builtin"


def test_batches_reproducible_and_reshuffled_per_epoch(tok_path):
    ds = _load(None, tok_path, seed=3)
    run = lambda d: [b[0].tolist() for b in d.batches(32, epochs=2)]
    first = run(ds)
    assert first == run(_load(None, tok_path, seed=3))
    assert first != run(_load(None, tok_path, seed=4))
    per_epoch = len(ds) // 32
    assert len(first) == 2 * per_epoch and all(len(b) == 32 for b in first)
    e0, e1 = sum(first[:per_epoch], []), sum(first[per_epoch:], [])
    assert e0 != e1 and len(set(e0)) == len(e0) == per_epoch * 32
    # batches carry matching ids, token arrays and texts
    idx, ids, texts = next(ds.batches(8))
    assert [ds.texts[i] for i in idx] == texts and all(np.array_equal(ds.prompt_ids[i], a) for i, a in zip(idx, ids))
    # resuming at epoch 1 gives the second epoch of the full stream
    assert [b[0].tolist() for b in ds.batches(32, epochs=1, start_epoch=1)] == first[per_epoch:]


def test_batches_last_partial_batch(tok_path):
    ds = _load(None, tok_path)  # 320 prompts
    kept = list(ds.batches(100, epochs=1, drop_last=False))
    assert [len(b[0]) for b in kept] == [100, 100, 100, 20]
    assert sorted(np.concatenate([b[0] for b in kept]).tolist()) == list(range(320))
    assert [len(b[0]) for b in ds.batches(100, epochs=1)] == [100, 100, 100]
    endless = ds.batches(100, epochs=None)
    assert len([next(endless) for _ in range(10)]) == 10
    with pytest.raises(ValueError) as e:
        next(ds.batches(1000))
    assert "1000" in _one_line(e) and "320" in str(e.value)


def test_split_eval_disjoint_and_deterministic(tok_path):
    ds = _load(None, tok_path, seed=5)
    train, ev = ds.split_eval(20)
    assert len(ev) == 20 and len(train) == 300
    assert not set(train.ids.tolist()) & set(ev.ids.tolist())
    assert sorted(train.ids.tolist() + ev.ids.tolist()) == list(range(320))
    assert all(ds.texts[i] == t for i, t in zip(ev.ids, ev.texts))
    assert ev.ids.tolist() == _load(None, tok_path, seed=5).split_eval(20)[1].ids.tolist()
    assert ev.ids.tolist() != _load(None, tok_path, seed=6).split_eval(20)[1].ids.tolist()
    seen = {i for b in train.batches(50, epochs=1, drop_last=False) for i in b[0].tolist()}
    assert seen == set(train.ids.tolist())
    assert len(ds.split_eval(0)[1]) == 0
    with pytest.raises(ValueError) as e:
        ds.split_eval(320)
    _one_line(e)


def test_chat_template(tmp_path, tok_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_path)
    tok.chat_template = ("{% for m in messages %}<|user|>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    chat_dir = tmp_path / "chat-tok"
    tok.save_pretrained(chat_dir)
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "The cat was"}) + "\n")
    ds = _load(p, str(chat_dir), chat_template=True)
    assert ds.texts == ["<|user|>The cat was\n<|assistant|>"]
    assert ds.prompt_ids[0].tolist() == tok(ds.texts[0], add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError) as e:
        _load(p, tok_path, chat_template=True)
    assert "chat_template" in _one_line(e) and tok_path in str(e.value)


def test_error_one_liners(tmp_path, tok_path):
    with pytest.raises(FileNotFoundError) as e:
        _load(tmp_path / "nope.jsonl", tok_path)
    assert "data.path" in _one_line(e) and "nope.jsonl" in str(e.value)

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError) as e:
        _load(empty, tok_path)
    assert "no prompts" in _one_line(e)

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "x"}) + "\n{oops\n")
    with pytest.raises(ValueError) as e:
        _load(bad, tok_path)
    msg = _one_line(e)
    assert "all 2 rows skipped" in msg and "data.field" in msg and "'prompt'" in msg

    csv = tmp_path / "p.csv"
    csv.write_text("prompt\nhi\n")
    with pytest.raises(ValueError) as e:
        _load(csv, tok_path)
    assert ".csv" in _one_line(e) and ".jsonl" in str(e.value) and ".parquet" in str(e.value)

    with pytest.raises(ValueError) as e:
        _load(None, tok_path, max_prompt_tokens=0)
    _one_line(e)


def test_missing_optional_readers_name_the_fix(tmp_path, tok_path, monkeypatch):
    pq = tmp_path / "p.parquet"
    pq.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError) as e:
        _load(pq, tok_path)
    assert "pip install pyarrow" in _one_line(e)
    with pytest.raises(ImportError) as e:
        _load(tmp_path, tok_path)
    assert "pip install datasets" in _one_line(e)


def test_parquet(tmp_path, tok_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["The cat was", None, "", "A dog felt"], "id": [1, 2, 3, 4]}), path)
    ds = _load(path, tok_path)
    assert ds.texts == ["The cat was", "A dog felt"]
    assert ds.skip_counts == {"not_a_string": 1, "empty": 1}
    assert any(r.startswith("row 1:") for r in ds.skipped)
    with pytest.raises(ValueError) as e:
        _load(path, tok_path, field="question")
    assert "missing_field=4" in _one_line(e)


def test_saved_hf_dataset(tmp_path, tok_path):
    datasets = pytest.importorskip("datasets")

    import pyarrow as pa
    from datasets.table import InMemoryTable

    def make(columns, name):  # an explicit fingerprint skips datasets' dill hashing of the table
        return datasets.Dataset(InMemoryTable(pa.table(columns)), fingerprint=f"test-{name}")

    rows = {"prompt": ["The cat was", "", "My friend felt"]}
    make(rows, "single").save_to_disk(str(tmp_path / "single"))
    ds = _load(tmp_path / "single", tok_path)
    assert ds.texts == ["The cat was", "My friend felt"] and ds.skip_counts == {"empty": 1}

    dd = datasets.DatasetDict({"train": make(rows, "train"), "test": make({"prompt": ["x"]}, "test")})
    dd.save_to_disk(str(tmp_path / "dict"))
    assert _load(tmp_path / "dict", tok_path).texts == ["The cat was", "My friend felt"]

    datasets.DatasetDict({"test": make(rows, "only-test")}).save_to_disk(str(tmp_path / "notrain"))
    with pytest.raises(ValueError) as e:
        _load(tmp_path / "notrain", tok_path)
    assert "train" in _one_line(e)

    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError) as e:
        _load(tmp_path / "plain", tok_path)
    assert "save_to_disk" in _one_line(e)

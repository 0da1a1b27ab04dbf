"""PTX text: packing, per-step row choice, sources and their errors, the per-rank split."""
import json

import numpy as np
import pytest

from cluster.data.ptx import PTXData, pack
from learner.objectives.minibatches import split_rows

pytestmark = pytest.mark.unit


def test_pack_concatenates_and_drops_the_tail():
    docs = [np.array([1, 2, 3]), np.array([4, 5]), np.array([6, 7, 8, 9])]
    assert pack(docs, 4).tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]  # 9 is a partial row
    assert pack(docs, 10).shape == (0, 10)


def test_rows_for_step_is_a_function_of_the_step_and_covers_every_row():
    data = PTXData(rows=np.arange(10 * 3).reshape(10, 3), source="t", seed=4)
    first = [data.rows_for_step(s, 4) for s in range(5)]  # 20 rows = 2 passes over 10
    again = PTXData(rows=data.rows.copy(), source="t", seed=4)
    assert all(np.array_equal(a, again.rows_for_step(s, 4)) for s, a in enumerate(first))
    seen = np.concatenate(first)[:, 0] // 3
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))  # once per pass
    assert not np.array_equal(seen[:10], seen[10:])  # each pass in a new order


def test_load_from_jsonl_decodes_to_the_source_text(tmp_path, policy_path, tokenizer):
    texts = ["the quiet river ran past the mill", "a kind word goes far", "warm bread at dawn"] * 20
    path = tmp_path / "text.jsonl"
    path.write_text("\n".join(json.dumps({"body": t}) for t in texts) + "\n{\"body\": 3}\n")
    data = PTXData.load(path=str(path), field="body", tokenizer_path=policy_path, seq_len=16,
                        builtin_policy=False)
    assert data.rows.shape[1] == 16 and len(data) > 5
    eos = tokenizer.eos_token
    stream = eos.join(texts) + eos
    for row in data.rows_for_step(0, 3):
        assert tokenizer.decode(row) in stream


@pytest.mark.parametrize("kwargs, message", [
    (dict(path=None, builtin_policy=False), "needs pretraining text for this policy: set ptx.path"),
    (dict(path="{tmp}/none.jsonl"), "ptx.path: {tmp}/none.jsonl does not exist"),
    (dict(path="{tmp}/wrong.jsonl"), "ptx.field='text' is in none of the 2 rows"),
    (dict(path="{tmp}/short.jsonl"), "fewer than ptx.seq_len=64 tokens"),
    (dict(path=None, seq_len=1), "ptx.seq_len=1 must be >= 2"),
])
def test_bad_ptx_sources(tmp_path, policy_path, kwargs, message):
    (tmp_path / "wrong.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    (tmp_path / "short.jsonl").write_text('{"text": "too short"}\n')
    args = dict(field="text", tokenizer_path=policy_path, seq_len=64, builtin_policy=True)
    args.update({k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in kwargs.items()})
    with pytest.raises((ValueError, FileNotFoundError), match=message.format(tmp=tmp_path).replace("(", r"\(")):
        PTXData.load(**args)


def test_split_rows_gives_each_rank_its_block():
    rows = np.arange(12).reshape(6, 2)
    a, b = split_rows(rows, 2)
    assert a.tolist() == [[0, 1], [2, 3], [4, 5]] and b.tolist() == [[6, 7], [8, 9], [10, 11]]
    assert split_rows(None, 3) == [None, None, None]
    with pytest.raises(ValueError, match="multiple of the 4 ranks"):
        split_rows(rows, 4)
    with pytest.raises(ValueError, match="2-D"):
        split_rows(np.arange(4), 2)

"""A prompt row's other fields: kept by PromptDataset (data.columns), carried by its ids through
split_eval, rows lacking a required one skipped, and what the driver shows of them (samples.jsonl,
reward/<source>/mean)."""
import json

import numpy as np
import pytest

from cluster.data.prompts import PromptDataset
from cluster.demo.tiny_models import build_tokenizer
from cluster.runtime.observe.step_row import decode_sample, source_metrics
from core.columns import PromptColumns
from core.rollout import BatchSummary, ScoredRollout

pytestmark = pytest.mark.unit

ROWS = [{"prompt": "The cat was", "answer": 3, "source": "a", "meta": {"k": [1]}},
        {"prompt": "My friend felt", "answer": "x", "source": "b"},
        {"prompt": "The weather", "source": "a"},  # no answer
        {"prompt": "A dog", "answer": None, "source": "b"},  # null answer
        {"prompt": "The sea", "answer": 5.5}]


@pytest.fixture(scope="module")
def tok_path():
    return str(build_tokenizer())


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def test_every_other_field_is_kept_with_its_json_type(data, tok_path):
    ds = PromptDataset.load(path=str(data), tokenizer_path=tok_path)
    assert ds.columns.names == ("answer", "source", "meta")  # never the prompt field
    assert ds.columns.take(ds.ids.tolist()) == {
        "answer": [3, "x", None, None, 5.5], "source": ["a", "b", "a", "b", None],
        "meta": [{"k": [1]}, None, None, None, None]}


def test_data_columns_keeps_only_those_named_and_refuses_one_no_row_has(data, tok_path):
    ds = PromptDataset.load(path=str(data), tokenizer_path=tok_path, columns=("answer",))
    assert ds.columns.names == ("answer",)
    with pytest.raises(ValueError) as e:
        PromptDataset.load(path=str(data), tokenizer_path=tok_path, columns=("answer", "solution"))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("data.columns names 'solution', which no row of")
    assert "'answer', 'meta', 'prompt', 'source'" in msg


def test_rows_lacking_a_required_column_are_skipped_and_counted(data, tok_path):
    ds = PromptDataset.load(path=str(data), tokenizer_path=tok_path, required_columns={"answer"})
    assert ds.skip_counts == {"missing_column": 2} and len(ds) == 3
    assert "line 3: no value for the column 'answer'" in ds.skipped[0]
    assert ds.columns.take(ds.ids.tolist())["answer"] == [3, "x", 5.5]
    assert ds.texts[2] == "The sea"  # ids stay 0..N-1 over the kept rows
    # A required column that NO row has is not a row problem: the start-up probe names the function.
    none = PromptDataset.load(path=str(data), tokenizer_path=tok_path, required_columns={"solution"})
    assert len(none) == 5 and none.num_skipped == 0


def test_parquet_rows_keep_every_column(tmp_path, tok_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"prompt": ["The cat was", "A dog"], "answer": [1, 2], "source": ["a", "b"]}), path)
    ds = PromptDataset.load(path=str(path), tokenizer_path=tok_path)
    assert ds.columns.take([1, 0]) == {"answer": [2, 1], "source": ["b", "a"]}


def test_eval_prompts_keep_their_ids_and_so_their_columns(data, tok_path):
    ds = PromptDataset.load(path=str(data), tokenizer_path=tok_path)
    train, held = ds.split_eval(2)
    for part in (train, held):
        got = part.columns.take(part.ids.tolist())["source"]
        assert got == [ROWS[i].get("source") for i in part.ids.tolist()]
    # the builtin prompts have none
    assert PromptDataset.load(path=None, tokenizer_path=tok_path).columns.names == ()


def _rollout(prompt_index, score, sample_index=0):
    r = np.array([5, 6])
    return ScoredRollout(prompt_ids=np.array([1, 2]), response_ids=r, behaviour_logprobs=np.zeros(2),
                         finish_reason="stop", policy_version=0, prompt_index=prompt_index,
                         sample_index=sample_index, reference_logprobs=np.zeros(2), kl=np.zeros(2),
                         rewards=np.zeros(2), score=score)


def test_per_source_reward_and_samples_show_the_columns(tok_path):
    from transformers import AutoTokenizer

    columns = PromptColumns(ids=[0, 1, 2], rows=[{"source": "gsm8k", "answer": 4}, {"source": "math"}, {}])
    batch = BatchSummary.of([_rollout(0, 1.0), _rollout(0, 3.0, 1), _rollout(1, -1.0), _rollout(2, 9.0)],
                            current_version=0)
    assert batch.prompt_indices.tolist() == [0, 0, 1, 2]
    assert source_metrics(batch, columns, "source") == {  # the row without a source is in no group
        "reward/gsm8k/mean": 2.0, "reward/gsm8k/count": 2, "reward/math/mean": -1.0, "reward/math/count": 1}
    assert source_metrics(batch, columns, "origin") == {}
    assert source_metrics(batch, PromptColumns(), "source") == {}
    tok = AutoTokenizer.from_pretrained(tok_path)
    rows = [decode_sample(tok, row, columns) for row in batch.samples]
    assert [r["columns"] for r in rows] == [{"source": "gsm8k", "answer": 4}, {"source": "math", "answer": None},
                                             {"source": None, "answer": None}]
    assert "columns" not in decode_sample(tok, batch.samples[0], PromptColumns())

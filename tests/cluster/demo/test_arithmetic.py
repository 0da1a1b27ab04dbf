"""The arithmetic demo task: its facts, corpus, rows and verifier (cluster/demo/arithmetic.py)."""
import json

import pytest

from cluster.demo import arithmetic as A

pytestmark = pytest.mark.unit


def test_facts_and_rows():
    facts = A.facts()
    assert len(facts) == 57 and len({p for p, _, _ in facts}) == 57
    assert sum(s == "add" for _, s, _ in facts) == 36 and sum(s == "sub" for _, s, _ in facts) == 21
    rows = A.prompt_rows()
    assert sorted(r["prompt"] for r in rows) == sorted(p for p, _, _ in facts)
    assert all(set(r) == {"prompt", "answer", "source"} and r["answer"] == A.answer_of(r["prompt"]) for r in rows)
    assert {"prompt": "3 plus 2 is", "answer": "5", "source": "add"} in rows
    assert A.prompt_rows(seed=1) != rows and A.prompt_rows() == rows
    assert len(A.prompt_rows(100)) == 100
    with pytest.raises(ValueError):
        A.prompt_rows(0)


def test_corpus_is_true_and_mostly_hedged():
    lines = A.corpus()
    assert lines == A.corpus() and lines != A.corpus(seed=1)
    answered = 0
    for line in lines:
        prompt, said = line[:-1].split(" is ")
        if said.startswith("not "):
            assert int(said[4:]) != int(A.answer_of(prompt + " is"))
        else:
            assert said == A.answer_of(prompt + " is")
            answered += 1
    assert 0.25 < answered / len(lines) < 0.35  # P_ANSWER = 0.3


@pytest.mark.parametrize("response, score", [
    (" 7.", 1.0), ("7", 1.0), (" 7", 1.0), (" 07.", 1.0), (" 8.", 0.0), (" not 5.", 0.0), (" not 7.", 0.0),
    (" 7 8.", 0.0), (" seven.", 0.0), ("", 0.0), (" 7..", 0.0)])
def test_exact(response, score):
    assert A.exact(["3 plus 4 is"], [response], answer=["7"]) == [score]
    assert A.exact(["3 plus 4 is"], [response], answer=["7"], source=["add"]) == [score]  # other columns: ignored


def test_reward_from_prompt_and_bad_input():
    prompts = ["3 plus 2 is", "5 minus 5 is", "4 minus 1 is"]
    assert A.reward_from_prompt(prompts, [" 5.", " 0.", " 2."]) == [1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="not an arithmetic prompt"):
        A.reward_from_prompt(["The cat was"], [" 5."])
    with pytest.raises(ValueError, match="2 responses"):
        A.exact(["3 plus 2 is"], [" 5.", " 6."], answer=["5"])


def test_write_rows(tmp_path, capsys):
    path = tmp_path / "d" / "prompts.jsonl"
    assert A.main(["--write", str(path)]) == 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == A.prompt_rows()
    with pytest.raises(SystemExit) as e:
        A.main([])
    assert e.value.code == 2


def test_ptx_batches_of_the_task_corpus():
    from transformers import AutoTokenizer

    from cluster.demo.pretrain import ptx_batches
    from cluster.demo.tiny_models import build_tokenizer

    path = build_tokenizer()
    tok = AutoTokenizer.from_pretrained(path)
    ids, mask = next(ptx_batches(path, batch_size=8, seed=0, texts=A.corpus()))
    lines = set(A.corpus())
    for row, m in zip(ids, mask):
        n = int(m.sum())
        assert row[n - 1] == tok.eos_token_id and tok.decode(row[: n - 1]) in lines

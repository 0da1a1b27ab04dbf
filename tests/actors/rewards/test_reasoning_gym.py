"""reasoning-gym's tasks as prompt rows (cluster.data.reasoning_gym) scored by their own verifiers
(actors.rewards:reasoning_gym) through the reward function's scorer, as a reward replica calls it:
the rows' rg_task and rg_entry columns reach the verifier, an answer in <answer> tags or bare is
read, a wrong one scores 0; an unknown task is one line."""
import pytest

from cluster.data.reasoning_gym import main, task_rows

pytestmark = pytest.mark.unit


def test_a_tasks_rows_are_scored_by_its_own_verifier(tmp_path, policy_path):
    from actors.rewards.config import RewardConfig
    from actors.rewards.source import configured_source
    from cluster.data.prompts import PromptDataset

    rows = tmp_path / "rows.jsonl"
    assert main(["--task", "basic_arithmetic", "--size", "6", "--seed", "3", "--out", str(rows)]) == 0
    data = PromptDataset.load(path=str(rows), tokenizer_path=policy_path, required_columns={"rg_task", "rg_entry"})
    assert len(data) == 6 and {"answer", "rg_task", "rg_entry"} <= set(data.columns.names)
    config = RewardConfig(function="actors.rewards:reasoning_gym")
    scorer = configured_source(config).text_scorer(config)
    columns = data.columns.take(data.ids)
    answers = columns["answer"]
    responses = [f"So <answer>{answers[0]}</answer>", answers[1], f"<answer>{int(answers[2]) + 1}</answer>",
                 "I do not know.", f"<answer> {answers[4]} </answer>", answers[5]]
    result = scorer.score_texts(data.texts, responses, columns)
    assert list(result.scores) == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0] and all(result.valid)


def test_an_unknown_task_is_one_line(tmp_path, capsys):
    assert main(["--task", "no_such_task", "--out", str(tmp_path / "x.jsonl")]) == 2
    out = capsys.readouterr().out.strip()
    assert out.startswith("error: reasoning-gym has no task 'no_such_task'") and "\n" not in out
    with pytest.raises(ValueError, match="no task"):
        task_rows("no_such_task", size=1)

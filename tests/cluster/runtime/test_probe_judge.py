"""The start-up checks of reward.judge (cluster/runtime/prepare.py): the path a judge replica will
run (the template filled from the rows, the judge's tokenizer and its chat template, the engine's
room, the labels) tried on example pairs, and refused in one line before any actor starts."""
import json
import shutil

import pytest

from cluster.config.ppo import load_config
from cluster.job.errors import UserError
from cluster.runtime.prepare import prepare

pytestmark = pytest.mark.integration  # prepare() builds (or finds) the tiny policy and judge
JUDGE = ["reward.function=null", "reward.judge.model=builtin:judge", "data.prompts_per_step=8", "data.eval_prompts=0"]
# Prompt rows as an SFT set has them: the prompt, a reference response, an answer.
ROWS = [{"prompt": p, "response": r, "answer": a} for p, r, a in
        [("The cat was", " happy.", 1), ("A dog felt", " sad.", 0)] * 4]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture
def data(tmp_path) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return str(path)


def _judge_with_chat_template(tmp_path, template: str) -> str:
    """The tiny judge, its tokenizer given ``template`` (as an instruct judge's has one)."""
    from transformers import AutoTokenizer

    from cluster.demo.judge import build_judge
    path = tmp_path / "chat-judge"
    shutil.copytree(build_judge(), path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = template
    tok.save_pretrained(path)
    return str(path)


def _refusal(overrides: list[str]) -> str:
    with pytest.raises(UserError) as e:
        prepare(load_config(None, [*JUDGE, *overrides]))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_data_column_named_response_is_refused_at_start_up(data):
    # Not refused, the run started and stopped at its first scoring: str.format got response twice.
    assert _refusal([f"data.path={data}"]) == (
        "the data has a column named 'response', which reward.judge.template cannot tell from the response being "
        "scored ({response}); rename that column in the data, or leave it out of data.columns")


def test_a_judge_reading_the_rows_columns_passes(data, tmp_path):
    prepare(load_config(None, [*JUDGE, f"data.path={data}", "data.columns=[answer]",
                               "reward.judge.template=Prompt: {prompt} ({answer})\nResponse: {response}\nScore:"]))
    chat_judge = _judge_with_chat_template(tmp_path, CHATML)
    prepare(load_config(None, [*JUDGE, f"data.path={data}", "data.columns=[answer]",
                               f"reward.judge.model={chat_judge}", "reward.judge.chat_template=true"]))


def test_a_chat_template_the_judge_lacks_or_cannot_render_is_refused(tmp_path):
    assert _refusal(["reward.judge.chat_template=true"]) == (
        "reward.judge.chat_template=true but the tokenizer of reward.judge.model='builtin:judge' has no chat template; "
        "set reward.judge.chat_template=false (the filled template is then the judge's whole input) or use an "
        "instruct judge")
    strict = _judge_with_chat_template(tmp_path, "{{ raise_exception('this judge takes a system turn first') }}")
    message = _refusal([f"reward.judge.model={strict}", "reward.judge.chat_template=true"])
    assert "cannot render the filled template as a user turn" in message
    assert "this judge takes a system turn first" in message


@pytest.mark.parametrize("overrides, needle", [
    (["reward.judge.template=Prompt: {prompt} {answer[0]}"], "reward.judge.template cannot be filled from the first "
     "training prompts' columns (TypeError: 'int' object is not subscriptable); fix the template or the data"),
    (["reward.judge.engine.max_model_len=12", "reward.judge.max_new_tokens=8"], "more than the 4 that reward.judge."
     "engine.max_model_len=12 leaves beside max_new_tokens=8; raise max_model_len or shorten the template"),
    (["reward.judge.choices={good and kind: 1.0, bad: 0.0}", "reward.judge.max_new_tokens=1"],
     "reward.judge.choices label 'good and kind' takes 3 tokens of the judge's tokenizer, more than "
     "reward.judge.max_new_tokens=1: the judge could never write it; raise max_new_tokens or shorten the label"),
])
def test_a_judge_that_cannot_read_the_example_pairs_is_refused(data, overrides, needle):
    assert needle in _refusal([f"data.path={data}", "data.columns=[answer]", *overrides])

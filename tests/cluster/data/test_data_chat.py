"""Prompt columns holding chats (lists of role/content messages): checked, skipped when malformed,
rendered by the tokenizer's chat template."""
import json

import pytest

from cluster.data.chat import message_problem
from cluster.data.prompts import PromptDataset
from cluster.demo.tiny_models import build_tokenizer
from core.infra.errors import InputError

# A template whose output is easy to write by hand: the expected texts below are literal.
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tok_path():
    return str(build_tokenizer())


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory, tok_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_path)
    tok.chat_template = TEMPLATE
    path = tmp_path_factory.mktemp("chat-tok")
    tok.save_pretrained(path)
    return str(path)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.unit
@pytest.mark.parametrize("messages, problem", [
    ([{"role": "user", "content": "Hi"}], None),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": "x"}], None),
    ([], "is an empty list of messages"),
    (["Hi"], "message 0 is str, not a {'role', 'content'} object"),
    ([{"role": "user"}], "message 0 has no string 'content'"),
    ([{"role": "user", "content": "Hi"}, {"content": "x"}], "message 1 has no string 'role'"),
    ([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "message 0 has no string 'content'"),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
     "ends with an assistant message (a prompt must end before the reply)"),
])
def test_message_problem(messages, problem):
    assert message_problem(messages) == problem


@pytest.mark.unit
def test_malformed_chats_are_skipped_and_counted(tmp_path, chat_tok):
    path = _jsonl(tmp_path / "p.jsonl", [
        {"prompt": [{"role": "user", "content": "The cat was"}]},
        {"prompt": []},
        {"prompt": [{"role": "user", "content": None}]},
        {"prompt": ["not a message"]},
        {"prompt": "A dog felt"},
        {"prompt": {"role": "user", "content": "a dict, not a list"}},
    ])
    ds = PromptDataset.load(path=str(path), tokenizer_path=chat_tok)
    assert ds.texts == ["<|user|>The cat was\n<|assistant|>", "A dog felt"]
    assert ds.skip_counts == {"bad_messages": 3, "not_a_string": 1}
    assert "line 2: field 'prompt' is an empty list of messages" in ds.skipped
    assert "line 4: field 'prompt' message 0 is str, not a {'role', 'content'} object" in ds.skipped
    with pytest.raises(ValueError) as e:
        PromptDataset.load(path=str(_jsonl(tmp_path / "bad.jsonl", [{"prompt": []}])), tokenizer_path=chat_tok)
    assert "bad_messages=1" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.unit
def test_chats_need_a_chat_template(tmp_path, tok_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": [{"role": "user", "content": "Hi"}]}])
    with pytest.raises(ValueError) as e:
        PromptDataset.load(path=str(path), tokenizer_path=tok_path)
    assert str(e.value) == (f"data.field 'prompt' holds chat messages but the tokenizer at {tok_path} has no "
                            "chat_template; use a chat model's tokenizer (model.tokenizer) or store the prompts "
                            "as plain strings")


@pytest.mark.integration
@pytest.mark.parametrize("chat_template", [False, True])
def test_chat_prompts_are_the_exact_template_text(tmp_path, chat_tok, chat_template):
    """Chats through the template with or without data.chat_template, which only decides for
    strings; templated text is tokenized without added special tokens, plain text with them."""
    from transformers import AutoTokenizer

    path = _jsonl(tmp_path / "p.jsonl", [
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The cat was"}]},
        {"prompt": "A dog felt"},
    ])
    ds = PromptDataset.load(path=str(path), tokenizer_path=chat_tok, chat_template=chat_template)
    plain = "<|user|>A dog felt\n<|assistant|>" if chat_template else "A dog felt"
    assert ds.texts == ["<|system|>Be brief.\n<|user|>The cat was\n<|assistant|>", plain]
    tok = AutoTokenizer.from_pretrained(chat_tok)
    assert ds.prompt_ids[0].tolist() == tok(ds.texts[0], add_special_tokens=False)["input_ids"]
    assert ds.prompt_ids[1].tolist() == tok(plain, add_special_tokens=not chat_template)["input_ids"]


@pytest.mark.integration
def test_the_system_prompt_goes_first_unless_a_chat_has_its_own(tmp_path, chat_tok):
    path = _jsonl(tmp_path / "p.jsonl", [
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The cat was"}]},
        {"prompt": [{"role": "user", "content": "A bird sang"}]}, {"prompt": "A dog felt"}])
    ds = PromptDataset.load(path=str(path), tokenizer_path=chat_tok, chat_template=True, system_prompt="Use tools.")
    assert ds.texts == ["<|system|>Be brief.\n<|user|>The cat was\n<|assistant|>",
                        "<|system|>Use tools.\n<|user|>A bird sang\n<|assistant|>",
                        "<|system|>Use tools.\n<|user|>A dog felt\n<|assistant|>"]


@pytest.mark.integration
def test_a_template_that_refuses_a_system_message_is_one_line(tmp_path, tok_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_path)
    tok.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                         "{% endif %}" + TEMPLATE)
    tok.save_pretrained(tmp_path / "tok")
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "A dog felt"}])
    with pytest.raises(InputError) as e:
        PromptDataset.load(path=str(path), tokenizer_path=str(tmp_path / "tok"), chat_template=True,
                           system_prompt="Use tools.")
    assert "refuses a system message" in str(e.value) and "System role not supported" in str(e.value)
    assert "\n" not in str(e.value)

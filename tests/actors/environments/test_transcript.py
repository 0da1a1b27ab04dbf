"""Observations as exact ids (actors/environments/transcript.py): what follows a policy's turn is the chat
template's own rendering of the observation message and the next generation prompt, found by
the fixed-prefix difference; templates where that does not hold are refused in one line."""
import pytest

from actors.environments.transcript import ObservationError, ObservationTokens
from cluster.demo.tiny_models import build_tokenizer

pytestmark = pytest.mark.unit

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
STRICT_ROLES = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
                "{{ raise_exception('roles must be user or assistant') }}{% endif %}"
                "<turn>{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"
                "{% if add_generation_prompt %}<turn>assistant: {% endif %}")
# Drops earlier assistant turns' text once another message follows (as templates that strip reasoning do).
REWRITES = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}<|a|>{{ eos_token }}"
            "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture
def tok():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(build_tokenizer()))


def test_an_observation_is_the_templates_message_and_next_generation_prompt(tok):
    tok.chat_template = CHATML
    obs = ObservationTokens(tok, role="tool")
    ids = obs.ids("<tool_response>84</tool_response>")
    # glue after the end of turn, the message, the generation prompt: as the template writes them
    assert tok.decode(ids) == "\n<|im_start|>tool\n<tool_response>84</tool_response>" + tok.eos_token + \
        "\n<|im_start|>assistant\n"
    # a transcript built from ids is the template's rendering of the whole chat, id for id
    turn = tok("a", add_special_tokens=False)["input_ids"] + [obs.end_of_turn_id]
    prompt = tok.apply_chat_template([{"role": "user", "content": "u"}], tokenize=True, add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    whole = tok.apply_chat_template([{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
                                     {"role": "tool", "content": "<tool_response>84</tool_response>"}],
                                    tokenize=True, add_generation_prompt=True)
    assert prompt + turn + ids == list(whole["input_ids"] if hasattr(whole, "keys") else whole)


def test_without_a_chat_template_the_plain_format_is_appended(tok):
    tok.chat_template = None
    obs = ObservationTokens(tok, plain_format="\nResult: {observation}\n")
    assert tok.decode(obs.ids("12")) == "\nResult: 12\n" and obs.end_of_turn_id == tok.eos_token_id


@pytest.mark.parametrize("template, role, says", [
    (STRICT_ROLES, "tool", "cannot render a 'tool' message: roles must be user or assistant"),
    (REWRITES, "user", "renders the earlier turns differently"),
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "user", "does not end an assistant turn")])
def test_a_template_that_cannot_append_by_prefix_is_refused_in_one_line(tok, template, role, says):
    tok.chat_template = template
    with pytest.raises(ObservationError, match=says) as e:
        ObservationTokens(tok, role=role, name="the policy's tokenizer")
    assert "\n" not in str(e.value)
    if template == STRICT_ROLES:
        assert ObservationTokens(tok, role="user").ids("x")  # the same template with a role it knows


def _ids(out):
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_a_first_observation_follows_the_prompt_as_the_next_message(tok):
    tok.chat_template = CHATML
    obs = ObservationTokens(tok)
    prompt = _ids(tok.apply_chat_template([{"role": "user", "content": "Find the exit."}], add_generation_prompt=True))
    joined = obs.after_prompt(prompt, "You are in a maze.")
    assert joined == _ids(tok.apply_chat_template([{"role": "user", "content": "Find the exit."},
                                                   {"role": "user", "content": "You are in a maze."}],
                                                  add_generation_prompt=True))
    with pytest.raises(ObservationError, match="does not end in the policy's tokenizer's chat generation prompt"):
        ObservationTokens(tok, name="the policy's tokenizer").after_prompt(tok("Find the exit.")["input_ids"], "x")
    tok.chat_template = None
    plain = ObservationTokens(tok, plain_format=" ({observation})")
    go = tok("Go")["input_ids"]
    assert tok.decode(plain.after_prompt(go, "dark")) == tok.decode(go) + " (dark)"

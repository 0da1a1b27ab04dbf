"""The start-up probe of env.environment (cluster/runtime/prepare.py): a class that fails on the
first prompt, or a chat template that cannot append observations as exact ids, is one line."""
import types

import pytest

from cluster.config.ppo import load_config
from cluster.demo.tiny_models import build_tokenizer
from cluster.job.errors import UserError
from cluster.runtime.prepare import probe_environment
from core.columns import PromptColumns

pytestmark = pytest.mark.integration
TRAIN = types.SimpleNamespace(texts=["What is 2+2?"], ids=[0], columns=PromptColumns([0], [{"answer": 4}]),
                              prompt_ids=[[5, 6, 7]])
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture
def tok():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(build_tokenizer()))


def test_a_working_environment_passes(tok):
    probe_environment(load_config(None, ["env.environment=actors.environments:Calculator"]).env, TRAIN, tok)


def test_a_template_that_cannot_append_observations_is_one_line(tok):
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(UserError) as e:
        probe_environment(load_config(None, ["env.environment=actors.environments:Calculator"]).env, TRAIN, tok)
    assert "does not end an assistant turn" in str(e.value) and "env.observation_role" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_class_that_fails_to_reset_is_one_line(tok):
    env = load_config(None, ["env.environment=actors.environments:MalformedToolCall"]).env
    with pytest.raises(UserError, match="has no reset and no step method"):
        probe_environment(env, TRAIN, tok)
    env = load_config(None, ["env.environment=test_probe_environment:Broken"]).env
    with pytest.raises(UserError) as e:
        probe_environment(env, TRAIN, tok)
    assert str(e.value) == ("env.environment 'test_probe_environment:Broken' failed on the first training prompt: "
                            "environment test_probe_environment:Broken.reset raised KeyError: 'level'")


def test_a_first_observation_after_a_prompt_without_the_chat_template_is_one_line(tok):
    tok.chat_template = CHATML  # the prompts were not rendered with it (data.chat_template=false)
    env = load_config(None, ["env.environment=test_probe_environment:Greets"]).env
    with pytest.raises(UserError) as e:
        probe_environment(env, TRAIN, tok)
    assert "its reset returned a first observation" in str(e.value) and "data.chat_template=true" in str(e.value)
    assert "\n" not in str(e.value)


class Greets:
    def reset(self, prompt, columns):
        return "Welcome."

    def step(self, action):
        return None, 0.0, True, {}


class Broken:
    """Needs a column the data does not have."""

    def reset(self, prompt, columns):
        return columns["level"]

    def step(self, action):
        return None, 0.0, True, {}

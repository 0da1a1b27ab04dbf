"""OpenAI's request bodies as the gateway checks them (actors/gateway/api.py), and its answers read by
the real `openai` client's own response types."""
import pytest

from actors.gateway.api import (
    Answer,
    ApiError,
    chat_request,
    chat_response,
    completion_request,
    completion_response,
    reward_of,
)
from core.modeling.engine_config import SamplingConfig

pytestmark = pytest.mark.unit

RUN = SamplingConfig(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=16)
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}


def refused(body, parse=chat_request) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(body, served="policy", sampling=RUN)
    assert "\n" not in str(e.value)
    return e.value


def test_a_chat_body_is_read_with_the_runs_defaults():
    call = chat_request({**CHAT, "messages": [{"role": "system", "content": [{"type": "text", "text": "be "},
                                                                            {"type": "text", "text": "brief"}]},
                                             {"role": "user", "content": "hi"}],
                         "temperature": 1, "top_k": -1, "stop": "\n", "logprobs": True, "user": "me"},
                        served="policy", sampling=RUN)
    assert call.chat and call.max_tokens == 16 and call.stop == ("\n",) and call.logprobs
    assert call.messages[0] == {"role": "system", "content": "be brief"} and call.extra == {"user": "me"}
    assert chat_request({**CHAT, "max_completion_tokens": 4, "max_tokens": 9}, served="policy",
                        sampling=RUN).max_tokens == 4  # the newer name wins


@pytest.mark.parametrize("extra, param, words", [
    ({"n": 2}, "n", "one choice per call"),
    ({"stream": True}, "stream", "send stream=false"),
    ({"temperature": 0.7}, "temperature", "generator.sampling.temperature=1.0"),
    ({"top_p": 0.9}, "top_p", "generator.sampling.top_p=1.0"),
    ({"presence_penalty": 0.5}, "presence_penalty", "send 0"),
    ({"max_tokens": 17}, "max_tokens", "generator.sampling.max_new_tokens=16"),
    ({"max_tokens": 0}, "max_tokens", "positive integer"),
    ({"tool_choice": "required"}, "tool_choice", "'auto' or 'none'"),
    ({"top_logprobs": 3}, "top_logprobs", "send 0"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"frobnicate": 1}, "frobnicate", "Unrecognized request argument supplied: frobnicate"),
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0]", "role must be one of"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0]",
     "no images"),
])
def test_what_a_run_cannot_train_on_is_refused_naming_the_parameter(extra, param, words):
    e = refused({**CHAT, **extra})
    assert e.status == 400 and e.param == param and words in str(e)


def test_a_model_it_does_not_serve_is_not_found():
    e = refused({**CHAT, "model": "gpt-5"})
    assert e.status == 404 and e.code == "model_not_found" and "serves `policy`" in str(e)
    assert refused([1, 2]).status == 400


def test_a_completions_body():
    call = completion_request({"model": "policy", "prompt": ["3 plus 4 is"], "logprobs": 1, "max_tokens": 3},
                              served="policy", sampling=RUN)
    assert not call.chat and call.prompt == "3 plus 4 is" and call.logprobs and call.max_tokens == 3
    assert refused({"model": "policy", "prompt": ["a", "b"]}, completion_request).param == "prompt"
    assert refused({"model": "policy", "prompt": "a", "echo": True}, completion_request).param == "echo"
    assert refused({"model": "policy", "prompt": "a", "logprobs": 5}, completion_request).param == "logprobs"


def test_the_answers_parse_as_the_openai_clients_own_types():
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    answer = Answer(call_id="s-1", text="hello", tokens=["hel", "lo"], logprobs=[-0.5, -0.25],
                    finish_reason="stop", prompt_tokens=7, created=1)
    chat = ChatCompletion.model_validate(chat_response(answer, model="policy", logprobs=True))
    assert chat.choices[0].message.content == "hello" and chat.usage.total_tokens == 9
    assert [t.logprob for t in chat.choices[0].logprobs.content] == [-0.5, -0.25]
    text = Completion.model_validate(completion_response(answer, model="policy", logprobs=True))
    assert text.choices[0].text == "hello" and text.choices[0].logprobs.text_offset == [0, 3]
    assert ApiError("x", param="n").body() == {"error": {"message": "x", "type": "invalid_request_error",
                                                         "param": "n", "code": None}}


def test_a_posted_reward_is_one_finite_number():
    assert reward_of({"reward": 1}) == 1.0
    for body, param in (({"reward": True}, "reward"), ({"reward": float("nan")}, "reward"), ({"score": 1}, "score"),
                        ([1], "reward"), ({"reward": "1"}, "reward")):
        with pytest.raises(ApiError) as e:
            reward_of(body)
        assert e.value.status == 400 and e.value.param == param


def test_a_tool_parser_vllm_does_not_have_is_one_line_listing_those_it_has():
    from actors.gateway.tool_calls import check_parser

    check_parser("hermes")
    with pytest.raises(ValueError) as e:
        check_parser("hermes2")
    assert "env.tool_parser='hermes2'" in str(e.value) and "hermes, " in str(e.value) and "\n" not in str(e.value)

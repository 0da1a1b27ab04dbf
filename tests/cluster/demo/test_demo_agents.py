"""The recipe's calculator agent (cluster.demo.agents): it runs each tool call of the policy's
answer with the safe calculator and sends the results back, answers a bad call with an error
the policy can read, and scores the final answer with Math-Verify. Its client here answers as
the gateway does, in the openai package's own types (the gateway itself: tests/actors/gateway)."""
import json

import pytest
from openai.types.chat import ChatCompletion

from cluster.demo.agents import MAX_CALLS, calculator_agent

pytestmark = pytest.mark.unit


def completion(content=None, calls=()):
    return ChatCompletion.model_validate({
        "id": "c", "object": "chat.completion", "created": 0, "model": "policy",
        "choices": [{"index": 0, "finish_reason": "tool_calls" if calls else "stop", "message": {
            "role": "assistant", "content": content,
            "tool_calls": [{"id": f"call-{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                           for i, (n, a) in enumerate(calls)] or None}}]})


class Scripted:
    """An OpenAI client whose answers are given in order; it keeps the messages it was sent."""

    def __init__(self, *answers):
        self.answers, self.sent = list(answers), []
        self.chat = self
        self.completions = self

    def create(self, *, model, messages, tools):
        assert model == "policy" and tools[0]["function"]["name"] == "calculator"
        self.sent.append(json.loads(json.dumps(messages)))
        return self.answers.pop(0)


def test_the_calculator_agent_runs_the_policys_calls_and_scores_its_answer():
    client = Scripted(completion("Half of 48:", [("calculator", {"expression": "48/2"}), ("abacus", {"x": 1})]),
                      completion(None, [("calculator", {"expression": "48 +"})]),
                      completion("So she sold 72 clips."))
    score = calculator_agent("How many clips?", {"answer": "48/2 = 24, 48+24 = 72\n#### 72"}, client=client)
    assert score == 1.0 and len(client.sent) == 3
    tools = [m for m in client.sent[1] if m["role"] == "tool"]
    assert [t["content"] for t in tools] == ["24", "error: there is no tool 'abacus'; use calculator"]
    assert client.sent[2][-1]["role"] == "tool" and client.sent[2][-1]["content"].startswith("error: ")


def test_an_agent_that_never_answers_scores_zero():
    client = Scripted(*[completion(None, [("calculator", {"expression": "1+1"})])] * MAX_CALLS)
    assert calculator_agent("Q", {"answer": "#### 2"}, client=client) == 0.0 and len(client.sent) == MAX_CALLS

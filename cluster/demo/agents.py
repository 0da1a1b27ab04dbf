"""Agent programs for the recipes: agents written against the OpenAI client, as users write them.

``calculator_agent`` (configs/agent-calculator-gpu.yaml) solves a word problem with a
calculator tool through OpenAI's tool calling: it asks the policy, runs each tool call the
answer holds with the built-in safe calculator and sends the results back, until the policy
answers without a call (at most ``MAX_CALLS`` calls); the answer is scored by Math-Verify
against the row's ``answer`` (actors.rewards:math).
"""
from __future__ import annotations

import json

MAX_CALLS = 6
SYSTEM = ("You can use a calculator tool for arithmetic. When you know the answer, reply without a tool call "
          "and end with the final number.")
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluates an arithmetic expression, e.g. 48/2 + 3*4",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


def run_tool(call) -> str:
    """One tool call's result as the policy reads it (an error as text: the policy's to fix)."""
    from actors.environments.calculator import calculator

    if call.function.name != "calculator":
        return f"error: there is no tool {call.function.name!r}; use calculator"
    try:
        return str(calculator(**json.loads(call.function.arguments)))
    except Exception as e:  # noqa: BLE001 - a bad call is answered, as a tool server would
        return f"error: {type(e).__name__}: {e}"


def calculator_agent(prompt: str, columns: dict, *, client) -> float:
    """The episode's score: 1.0 for a right final answer, else 0.0."""
    from actors.rewards import math

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
    for _ in range(MAX_CALLS):
        message = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return math([prompt], [message.content or ""], answer=[columns["answer"]])[0] or 0.0
        messages += [{"role": "tool", "tool_call_id": c.id, "content": run_tool(c)} for c in message.tool_calls]
    return 0.0

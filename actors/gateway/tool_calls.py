"""Tool calls read from the policy's chat answers, by one of vLLM's tool parsers.

A chat call that passes ``tools`` gets the policy's answer as OpenAI's ``tool_calls`` when the
run names the parser of the policy's format (``env.tool_parser``: ``hermes`` for Qwen's
``<tool_call>{...}</tool_call>``, ``llama3_json``, ``mistral``, ... the names vLLM registers).
The parser reads the answer's text with its special tokens (a format's tags may be special
tokens), and the answer keeps the text outside the calls as its ``content``. What the learner
trains on does not change: the ids vLLM sampled.
"""
from __future__ import annotations

from typing import Optional


def parser_names() -> list[str]:
    from vllm.tool_parsers import ToolParserManager

    return sorted(set(ToolParserManager.tool_parsers) | set(ToolParserManager.lazy_parsers))


def check_parser(name: str, key: str = "env.tool_parser") -> None:
    """A one-line ValueError for a parser vLLM does not have, listing the ones it has."""
    names = parser_names()
    if name not in names:
        raise ValueError(f"{key}={name!r} is not one of vLLM's tool parsers; use one of {', '.join(names)}")


class ToolCallReader:
    """``read(text, messages, tools)`` -> (the content, OpenAI's tool_calls: [] when none)."""

    def __init__(self, name: str, tokenizer) -> None:
        from vllm.tool_parsers import ToolParserManager

        check_parser(name)
        self.name, self._parser, self._tokenizer = name, ToolParserManager.get_tool_parser(name), tokenizer

    def read(self, text: str, messages: list[dict], tools: list[dict]) -> tuple[Optional[str], list[dict]]:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest(model="policy", messages=messages, tools=tools)
        parser = self._parser(self._tokenizer, request.tools)
        info = parser.extract_tool_calls(text, request)
        if not info.tools_called:
            return text, []
        calls = [{"id": call.id, "type": "function",
                  "function": {"name": call.function.name, "arguments": call.function.arguments}}
                 for call in info.tool_calls]
        return info.content or None, calls

"""OpenAI's `/v1/chat/completions` and `/v1/completions` bodies as the gateway reads and writes them.

A request is checked against what the run can train on before anything is sampled: the
run's sampling distribution is fixed (the learner takes its log-probs at the run's
temperature, top-p and top-k), so a request may restate those values or leave them out, but
not change them; one choice per call (``n`` 1), no streaming, no penalties. Anything else is
refused as OpenAI refuses it: HTTP 400 (404 for a model it does not serve) with
``{"error": {"message", "type", "param", "code"}}``, one line naming the parameter and
what to send instead. The OpenAI client raises that as ``BadRequestError`` / ``NotFoundError``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from core.modeling.engine_config import SamplingConfig

MAX_STOP = 4  # OpenAI's limit on stop sequences
# Accepted and without effect here: who the caller is, and options that cannot change what is sampled.
IGNORED = {"user", "metadata", "store", "parallel_tool_calls", "service_tier", "seed"}
CHAT_KEYS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
             "stream", "stop", "logprobs", "top_logprobs", "tools", "tool_choice", "frequency_penalty",
             "presence_penalty", *IGNORED}
COMPLETION_KEYS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stop",
                   "logprobs", "echo", "frequency_penalty", "presence_penalty", *IGNORED}
ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """A request the gateway refuses: HTTP ``status`` with OpenAI's error body."""

    def __init__(self, message: str, *, param: Optional[str] = None, status: int = 400,
                 code: Optional[str] = None, type: str = "invalid_request_error") -> None:  # noqa: A002
        super().__init__(message)
        self.status, self.param, self.code, self.type = status, param, code, type

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class CallRequest:
    """What one call asks for, checked: the prompt (chat messages or text), its token cap, the
    stop strings that end it early, whether it wants the sampled tokens' log-probs."""
    max_tokens: int
    messages: Optional[list[dict]] = None   # a chat call
    prompt: Optional[str] = None            # a completions call
    tools: Optional[list[dict]] = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    extra: dict = field(default_factory=dict)  # ignored keys as sent (IGNORED)

    @property
    def chat(self) -> bool:
        return self.messages is not None


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    return body


def _unknown(body: dict, allowed: set) -> None:
    for key in body:
        if key not in allowed:
            raise ApiError(f"Unrecognized request argument supplied: {key}", param=key)


def check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError("you must provide a model parameter (GET /v1/models lists the one served)", param="model")
    if model != served:
        raise ApiError(f"The model `{model}` does not exist; this gateway serves `{served}` (the run's policy)",
                       param="model", status=404, code="model_not_found")


def _same_as_run(body: dict, sampling: SamplingConfig) -> None:
    """temperature, top_p and top_k: absent or the run's own values."""
    for key, run in (("temperature", sampling.temperature), ("top_p", sampling.top_p), ("top_k", sampling.top_k)):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ApiError(f"{key} must be a number", param=key)
        if key == "top_k" and value in (-1, 0) and run == 0:
            continue  # both spellings of "no top-k"
        if abs(float(value) - float(run)) > 1e-9:
            raise ApiError(f"{key}={value} differs from the run's generator.sampling.{key}={run}, at which the "
                           f"learner scores every token; send {run} or leave {key} out", param=key)
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise ApiError(f"{key}={body[key]} would sample from another distribution than the one trained on; "
                           f"send 0 or leave it out", param=key)
    if body.get("n") not in (None, 1):
        raise ApiError(f"n={body['n']}: one choice per call; a group of samples is several sessions "
                       "(generator.sampling.n of them per prompt)", param="n")
    if body.get("stream"):
        raise ApiError("stream=true is not supported: send stream=false (or leave it out)", param="stream")


def _max_tokens(body: dict, sampling: SamplingConfig, *keys: str) -> int:
    for key in keys:
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ApiError(f"{key} must be a positive integer, got {value!r}", param=key)
        if value > sampling.max_new_tokens:
            raise ApiError(f"{key}={value} is beyond the run's per-call budget generator.sampling.max_new_tokens="
                           f"{sampling.max_new_tokens}; ask for at most that", param=key)
        return value
    return sampling.max_new_tokens


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise ApiError(f"stop must be a non-empty string or a list of at most {MAX_STOP} of them", param="stop")
    return tuple(stops)


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(f"{where}.content must be a string or a list of text parts (no images or audio)", param=where)


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(f"{where}.role must be one of {', '.join(ROLES)}", param=where)
        msg = {k: v for k, v in m.items() if k != "content"}
        if m.get("content") is not None or m["role"] != "assistant":
            msg["content"] = _text(m.get("content"), where)
        out.append(msg)
    return out


def _tools(body: dict) -> Optional[list[dict]]:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise ApiError("tools must be a list of tool objects", param="tools")
    if choice not in (None, "auto", "none"):
        raise ApiError(f"tool_choice={choice!r}: the policy decides for itself whether to call a tool; send "
                       "'auto' or 'none'", param="tool_choice")
    return None if choice == "none" else tools or None


def chat_request(body: Any, *, served: str, sampling: SamplingConfig) -> CallRequest:
    """A `/v1/chat/completions` body, checked (ApiError otherwise)."""
    body = _object(body)
    _unknown(body, CHAT_KEYS)
    check_model(body, served)
    _same_as_run(body, sampling)
    if body.get("top_logprobs") not in (None, 0):
        raise ApiError("top_logprobs: only the sampled tokens' log-probs are returned; send 0 or leave it out",
                       param="top_logprobs")
    return CallRequest(max_tokens=_max_tokens(body, sampling, "max_completion_tokens", "max_tokens"),
                       messages=_messages(body), tools=_tools(body), stop=_stop(body),
                       logprobs=bool(body.get("logprobs")), extra={k: body[k] for k in IGNORED if k in body})


def completion_request(body: Any, *, served: str, sampling: SamplingConfig) -> CallRequest:
    """A `/v1/completions` body, checked (ApiError otherwise)."""
    body = _object(body)
    _unknown(body, COMPLETION_KEYS)
    check_model(body, served)
    _same_as_run(body, sampling)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError("prompt must be one non-empty string (one prompt per call)", param="prompt")
    if body.get("echo"):
        raise ApiError("echo=true is not supported: send echo=false", param="echo")
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0, 1) or isinstance(logprobs, bool):
        raise ApiError("logprobs: only the sampled token's log-prob is returned; send 0, 1 or null",
                       param="logprobs")
    return CallRequest(max_tokens=_max_tokens(body, sampling, "max_tokens"), prompt=prompt, stop=_stop(body),
                       logprobs=logprobs is not None, extra={k: body[k] for k in IGNORED if k in body})


@dataclass(frozen=True)
class Answer:
    """One call's answer: the text the caller sees, the tokens behind it, how it ended."""
    call_id: str
    text: str
    tokens: list[str]          # each answered token's text (for log-probs)
    logprobs: list[float]
    finish_reason: str         # "stop" (EOS or a stop string), "length", or "tool_calls"
    prompt_tokens: int
    created: int
    tool_calls: tuple = ()     # OpenAI's tool_calls read from the answer (tool_calls.py); text: the rest


def _usage(answer: Answer) -> dict:
    n = len(answer.tokens)
    return {"prompt_tokens": answer.prompt_tokens, "completion_tokens": n, "total_tokens": answer.prompt_tokens + n}


def chat_response(answer: Answer, *, model: str, logprobs: bool) -> dict:
    lp = None
    if logprobs:
        lp = {"content": [{"token": t, "logprob": float(v), "bytes": list(t.encode()), "top_logprobs": []}
                          for t, v in zip(answer.tokens, answer.logprobs)]}
    return {"id": f"chatcmpl-{answer.call_id}", "object": "chat.completion", "created": answer.created,
            "model": model, "choices": [{"index": 0, "message": _message(answer), "logprobs": lp,
                                         "finish_reason": answer.finish_reason}],
            "usage": _usage(answer)}


def _message(answer: Answer) -> dict:
    if not answer.tool_calls:
        return {"role": "assistant", "content": answer.text}
    return {"role": "assistant", "content": answer.text or None, "tool_calls": list(answer.tool_calls)}


def completion_response(answer: Answer, *, model: str, logprobs: bool) -> dict:
    lp = None
    if logprobs:
        offsets, at = [], 0
        for t in answer.tokens:
            offsets.append(at)
            at += len(t)
        lp = {"tokens": answer.tokens, "token_logprobs": [float(v) for v in answer.logprobs],
              "top_logprobs": None, "text_offset": offsets}
    return {"id": f"cmpl-{answer.call_id}", "object": "text_completion", "created": answer.created,
            "model": model, "choices": [{"index": 0, "text": answer.text, "logprobs": lp,
                                         "finish_reason": answer.finish_reason}],
            "usage": _usage(answer)}


def reward_of(body: Any) -> float:
    """A posted reward's body, ``{"reward": <finite number>}``."""
    value = body.get("reward") if isinstance(body, dict) else None
    extra = sorted(set(body) - {"reward"}) if isinstance(body, dict) else []
    if extra:
        raise ApiError(f"Unrecognized request argument supplied: {extra[0]}", param=extra[0])
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(f'post {{"reward": <a finite number>}}, got {body!r}'[:200], param="reward")
    return float(value)


def models_response(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "tether"}]}

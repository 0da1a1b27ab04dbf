"""A session's calls, and the token-exact transcripts they make.

An agent calls the gateway several times per episode, each time with the whole conversation
so far, which the gateway renders to ids with the policy's chat template. A call whose
prompt ids begin with the previous call's prompt and sampled ids *joins* that transcript:
the ids between (the template's glue, a tool result, the next user message) are context,
masked from the loss, and the new call's sampled ids follow, trained. The policy's tokens are
always the ids vLLM sampled, never ids re-encoded from their text.

An agent that re-renders the history as text may get other ids for the same text (a
non-canonical tokenisation the policy sampled, a template that renders an assistant turn
differently from how it ended). ``splice`` then puts the sampled ids back in place of the
re-rendered ones where the texts agree (token-in, token-out), and counts the mismatch. Where
the texts do not agree (the history was rewritten, e.g. summarised), the call starts a new
transcript of its own; the episode's score goes to each.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from actors.gateway.api import ApiError
from core.rollout import spliced_kept_ids


@dataclass
class Call:
    """One served call: the prompt ids sampled from, and the sampled ids the answer kept (cut
    after a stop string), their behaviour log-probs and the policy version of each."""
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: str
    kept_ids: Optional[np.ndarray] = None  # [n, K] the sampler's kept sets (truncated sampling), else None


@dataclass
class Transcript:
    """A prompt, then the policy's tokens (``mask`` True) and the context between calls."""
    prompt_ids: list[int]
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    calls: int = 0
    finish_reason: str = "length"
    kept: list = field(default_factory=list)  # (first position, a call's kept sets) as Rollout.kept_ids wants

    @property
    def ids(self) -> list[int]:
        """Everything so far: what a call must begin with to join."""
        return self.prompt_ids + self.response

    def add(self, call: Call, context: list[int]) -> None:
        last = self.versions[-1] if self.versions else int(call.versions[0]) if len(call.versions) else 0
        if call.kept_ids is not None:
            self.kept.append((len(self.response) + len(context), np.asarray(call.kept_ids, dtype=np.int32)))
        self.response += context + list(call.token_ids)
        self.logprobs += [0.0] * len(context) + [float(v) for v in call.logprobs]
        self.mask += [False] * len(context) + [True] * len(call.token_ids)
        self.versions += [last] * len(context) + [int(v) for v in call.versions]
        self.calls += 1
        self.finish_reason = call.finish_reason

    def kept_ids(self) -> Optional[np.ndarray]:
        """[R, K] the calls' kept sets padded with -1 (context rows all -1); None untruncated."""
        return spliced_kept_ids(self.kept, len(self.response))


def splice(history: list[int], prompt_ids: list[int], decode: Callable[[list[int]], str]) -> Optional[list[int]]:
    """``prompt_ids`` with its head replaced by ``history`` (a transcript's exact ids) where the
    head decodes to the same text; None where no head does (the history was rewritten)."""
    if prompt_ids[:len(history)] == history:
        return list(prompt_ids)
    text = decode(history)
    if not decode(prompt_ids).startswith(text):
        return None
    # the shortest head of the prompt whose text covers the history's (ids near its length)
    for k in range(1, len(prompt_ids) + 1):
        head = decode(prompt_ids[:k])
        if head == text:
            return list(history) + list(prompt_ids[k:])
        if len(head) > len(text):
            return None  # a token straddles the boundary: no clean place to splice
    return None


def same_answer(message: dict, answer: dict) -> bool:
    """Whether a history's assistant ``message`` is the ``answer`` the gateway returned (its text
    and its tool calls, arguments compared as JSON)."""
    if message.get("role") != "assistant" or (message.get("content") or "") != (answer.get("content") or ""):
        return False
    calls = lambda m: [(c.get("function", {}).get("name"), _json(c.get("function", {}).get("arguments")))  # noqa: E731
                       for c in m.get("tool_calls") or ()]
    return calls(message) == calls(answer)


def _json(text):
    try:
        return json.loads(text) if isinstance(text, str) else text
    except ValueError:
        return text


def answer_splice(history: list[int], messages: list[dict], answer: dict, render: Callable, eos: int
                  ) -> Optional[list[int]]:
    """The next prompt with ``history`` (the transcript, ending in the sampled ``answer``) in place
    of the template's rendering of everything up to that answer, when the caller sent the answer
    back as the gateway returned it (e.g. as ``tool_calls``, which the template renders as text
    of its own). ``render(messages, generation_prompt)`` -> ids. The template's glue after the
    answer's end-of-turn (``eos``) is kept. None where the answer is not in the history as sent,
    or the template does not render the history as a prefix of the whole."""
    at = next((k for k in range(len(messages) - 1, -1, -1) if same_answer(messages[k], answer)), None)
    if at is None:
        return None
    before, through, full = render(messages[:at], True), render(messages[:at + 1], False), render(messages, True)
    if full[:len(through)] != through or through[:len(before)] != before:
        return None
    own = through[len(before):]  # the answer as the template renders it, with its glue
    glue = own[len(own) - own[::-1].index(eos):] if eos in own else []
    return list(history) + glue + full[len(through):]


class Session:
    """One episode's calls through the gateway: ``(prompt_index, sample_index)`` seed them."""

    def __init__(self, sid: str, *, prompt_index: int, sample_index: int) -> None:
        self.sid, self.prompt_index, self.sample_index = sid, prompt_index, sample_index
        self.transcripts: list[Transcript] = []
        self.counts = {"calls": 0, "joined": 0, "retokenize_mismatch": 0, "rewritten": 0,
                       "prompt_tokens": 0, "cached_tokens": 0}  # the calls' prompts, and what the prefix cache held
        self.score: Optional[float] = None
        self.replica: Optional[str] = None  # the generator its calls go to while it lives
        self.answer: Optional[dict] = None  # the last chat answer as returned (content, tool_calls)

    def post_reward(self, reward: float) -> None:
        """The episode's score as the agent posted it (once)."""
        if self.score is not None:
            raise ApiError(f"a reward was already posted for session {self.sid!r} ({self.score}); an episode has one "
                           "score", status=409, code="reward_already_posted")
        self.score = float(reward)

    def prompt_for(self, prompt_ids: list[int], decode: Callable[[list[int]], str],
                   at_answer: Callable[[list[int]], Optional[list[int]]] = lambda history: None) -> list[int]:
        """The ids to sample the next call from: ``prompt_ids`` (as rendered from the caller's
        messages), with the last transcript's exact ids in place of their re-rendering: where
        the texts agree, or else as ``at_answer(history)`` puts them (answer_splice: the caller
        sent the last answer back as it was returned)."""
        if not self.transcripts:
            return list(prompt_ids)
        history = self.transcripts[-1].ids
        spliced = splice(history, prompt_ids, decode) or at_answer(history)
        if spliced is None:
            return list(prompt_ids)
        if spliced != list(prompt_ids):
            self.counts["retokenize_mismatch"] += 1
        return spliced

    def response_tokens(self, prompt_ids: list[int]) -> int:
        """The response tokens a call from ``prompt_ids`` starts with: what follows the last
        transcript's prompt if the call joins it, else none (it starts a transcript)."""
        last = self.transcripts[-1] if self.transcripts else None
        if last is not None and prompt_ids[:len(last.ids)] == last.ids:
            return len(prompt_ids) - len(last.prompt_ids)
        return 0

    def record(self, call: Call) -> None:
        """Add a served call: it joins the last transcript if its prompt begins with it, else starts one."""
        self.counts["calls"] += 1
        last = self.transcripts[-1] if self.transcripts else None
        if last is not None and call.prompt_ids[:len(last.ids)] == last.ids:
            last.add(call, call.prompt_ids[len(last.ids):])
            self.counts["joined"] += 1
            return
        if last is not None:
            self.counts["rewritten"] += 1
        t = Transcript(prompt_ids=list(call.prompt_ids))
        t.add(call, [])
        self.transcripts.append(t)

"""An environment's observation as the exact token ids that follow the policy's turn.

A multi-turn transcript is built from ids, never from text: the policy's turns are the ids vLLM
sampled, and an observation is tokenized on its own and appended, so no decode and re-encode
ever changes a sampled token. What to append after a turn is found by the chat template's
fixed-prefix difference: render a fixed short chat that ends with an assistant message, then
the same chat with the observation as the next message and the generation prompt; the first
rendering, cut after its end-of-turn token, is a prefix of the second, and the ids after it
are the observation's: the template's glue after the end of turn, the observation message,
and the next generation prompt. A tokenizer without a chat template appends
``plain_format`` with the observation in it, tokenized without special tokens.

    obs = ObservationTokens(tokenizer, role="user")
    ids = obs.ids("<tool_response>84</tool_response>")   # what follows a turn that ended at obs.end_of_turn_id
    prompt = obs.after_prompt(prompt_ids, "You are in a maze.")  # a first observation, before any turn

A first observation (an environment's ``reset``) joins the prompt the same way: the prompt's
generation prompt is taken off its end, and the template's rendering of the observation
message and a new generation prompt goes in its place.

A template for which the prefix does not hold (one that renders earlier turns differently once
a new message follows) is refused with one line at construction.
"""
from __future__ import annotations

from typing import Optional

BASE_CHAT = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


class ObservationError(ValueError):
    """The tokenizer's chat template cannot append observations by prefix difference."""


class ObservationTokens:
    """Observation text -> ids to append to a transcript; ``end_of_turn_id``: the id a turn ends on."""

    def __init__(self, tokenizer, *, role: str = "user", plain_format: str = "\n{observation}\n",
                 name: str = "tokenizer"):
        self.tokenizer, self.role, self.plain_format, self.name = tokenizer, role, plain_format, name
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ObservationError(f"{name} has no eos token: a policy turn has nothing to end on")
        self.end_of_turn_id = int(eos)
        self._base: Optional[list[int]] = None
        if self.chat:
            self._base = self._base_ids()
            self.ids("probe")  # the prefix property, checked once

    def _render(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
        if isinstance(out, dict) or hasattr(out, "keys"):  # a BatchEncoding in newer transformers
            out = out["input_ids"]
        return [int(i) for i in out]

    def _base_ids(self) -> list[int]:
        """The fixed chat rendered and cut after the assistant's end-of-turn token."""
        base = self._render(BASE_CHAT, False)
        ends = [i for i, t in enumerate(base) if t == self.end_of_turn_id]
        if not ends:
            raise ObservationError(f"{self.name}'s chat template does not end an assistant turn with its eos token "
                                   f"(id {self.end_of_turn_id}); a turn could not stop where the template ends it")
        return base[:ends[-1] + 1]

    def after_prompt(self, prompt_ids: list[int], observation: str) -> list[int]:
        """The prompt with a first observation after it, ready for the policy's first turn."""
        if not self.chat:
            return list(prompt_ids) + self.ids(observation)
        user = self._render(BASE_CHAT[:1], False)
        gen = self._render(BASE_CHAT[:1], True)
        full = self._message(BASE_CHAT[:1], observation)
        if gen[:len(user)] != user or full[:len(user)] != user:
            raise ObservationError(f"{self.name}'s chat template renders a user message differently once the "
                                   "generation prompt or another message follows; a first observation cannot be "
                                   "appended as exact ids")
        gen = gen[len(user):]
        if list(prompt_ids[len(prompt_ids) - len(gen):]) != gen:
            raise ObservationError(f"the prompt does not end in {self.name}'s chat generation prompt, so the "
                                   "environment's first observation cannot follow it as a message; render the "
                                   "prompts with the chat template (data.chat_template=true)")
        return list(prompt_ids[:len(prompt_ids) - len(gen)]) + full[len(user):]

    def _message(self, chat: list[dict], observation: str) -> list[int]:
        """``chat`` with the observation as the next message, and the generation prompt."""
        try:
            return self._render(chat + [{"role": self.role, "content": observation}], True)
        except Exception as e:  # noqa: BLE001 - a template's own refusal (e.g. a role it does not know)
            raise ObservationError(f"{self.name}'s chat template cannot render a {self.role!r} message: "
                                   f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None

    def ids(self, observation: str) -> list[int]:
        """The ids to append after a turn that ended on ``end_of_turn_id``."""
        if not self.chat:
            text = self.plain_format.format(observation=observation)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        full = self._message(BASE_CHAT, observation)
        if full[:len(self._base)] != self._base:
            raise ObservationError(f"{self.name}'s chat template renders the earlier turns differently once a "
                                   f"{self.role!r} message follows; observations cannot be appended as exact ids")
        return full[len(self._base):]

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

    def ids(self, observation: str) -> list[int]:
        """The ids to append after a turn that ended on ``end_of_turn_id``."""
        if not self.chat:
            text = self.plain_format.format(observation=observation)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        try:
            full = self._render(BASE_CHAT + [{"role": self.role, "content": observation}], True)
        except Exception as e:  # noqa: BLE001 - a template's own refusal (e.g. a role it does not know)
            raise ObservationError(f"{self.name}'s chat template cannot render a {self.role!r} message: "
                                   f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        if full[:len(self._base)] != self._base:
            raise ObservationError(f"{self.name}'s chat template renders the earlier turns differently once a "
                                   f"{self.role!r} message follows; observations cannot be appended as exact ids")
        return full[len(self._base):]

"""Prompts as the policy sees them: plain strings, or chats rendered by the tokenizer's template.

A prompt column holds either a string or, as many Hub datasets store it, a chat: a list of
messages ``[{"role": "system" | "user" | ..., "content": str}, ...]``. A chat has no plain-text
form, so it always goes through the tokenizer's chat template, ending in the assistant's turn
(``add_generation_prompt=True``); a string goes through it only with ``data.chat_template``,
as the user turn. Templated text carries its own special tokens, so it is tokenized without
added ones; a plain string gets the tokenizer's defaults.

    problem = message_problem(value)       # None for a usable chat, else why it is not one
    texts, ids = render_prompts(tok, prompts, chat_template=False, tokenizer_path=path, column="prompt")
"""
from __future__ import annotations

from core.infra.errors import InputError


def is_chat(value) -> bool:
    """A list: meant as a chat (``message_problem`` says whether it is a usable one)."""
    return isinstance(value, list)


def message_problem(messages: list) -> str | None:
    """Why ``messages`` is not a usable chat prompt, or None: it must be a non-empty list of
    dicts with string ``role`` and ``content``, not ending in the assistant's turn (the
    prompt would hold its own answer)."""
    if not messages:
        return "is an empty list of messages"
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"message {i} is {type(m).__name__}, not a {{'role', 'content'}} object"
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                return f"message {i} has no string '{key}'"
    if messages[-1]["role"] == "assistant":
        return "ends with an assistant message (a prompt must end before the reply)"
    return None


def chat_prompts(tok, prompts: list[str], tokenizer_path, system: str | None = None) -> list[str]:
    """Each prompt as the user turn of the tokenizer's chat template, ready for the reply."""
    if not getattr(tok, "chat_template", None):
        raise InputError(f"data.chat_template is true but the tokenizer at {tokenizer_path} has no "
                         f"chat_template; set data.chat_template: false or use a chat model's tokenizer")
    return render_chats(tok, [[{"role": "user", "content": p}] for p in prompts], tokenizer_path, "", system)


def render_chats(tok, chats: list[list[dict]], tokenizer_path, column: str, system: str | None = None) -> list[str]:
    """Each chat through the tokenizer's template, ending where the assistant's reply begins;
    ``system`` (data.system_prompt) first where the chat has no system message of its own."""
    if not getattr(tok, "chat_template", None):
        raise InputError(f"data.field '{column}' holds chat messages but the tokenizer at {tokenizer_path} has no "
                         "chat_template; use a chat model's tokenizer (model.tokenizer) or store the prompts as "
                         "plain strings")
    if system is not None:
        chats = [c if c[0]["role"] == "system" else [{"role": "system", "content": system}, *c] for c in chats]
    try:
        return [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    except Exception as e:  # noqa: BLE001 - a template's own refusal (e.g. one without a system role)
        if system is None:
            raise
        raise InputError(f"data.system_prompt: the chat template of the tokenizer at {tokenizer_path} refuses a "
                         f"system message ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                         "unset data.system_prompt and put the instructions in the prompts") from None


def render_prompts(tok, prompts: list, *, chat_template: bool, tokenizer_path, column: str,
                   system: str | None = None) -> tuple[list[str], list[list[int]]]:
    """``(texts, token ids)`` of ``prompts`` (strings and usable chats, in any mix), in order;
    ``system``: data.system_prompt."""
    chats = [i for i, p in enumerate(prompts) if is_chat(p)]
    plain = [i for i, p in enumerate(prompts) if not is_chat(p)]
    texts = list(prompts)
    if chats:
        for i, text in zip(chats, render_chats(tok, [prompts[i] for i in chats], tokenizer_path, column, system)):
            texts[i] = text
    if chat_template and plain:
        for i, text in zip(plain, chat_prompts(tok, [prompts[i] for i in plain], tokenizer_path, system)):
            texts[i] = text
    templated = set(chats) | (set(plain) if chat_template else set())
    ids: list[list[int]] = [[] for _ in prompts]
    for special, group in ((False, sorted(templated)), (True, [i for i in plain if i not in templated])):
        if group:
            for i, row in zip(group, tok([texts[i] for i in group], add_special_tokens=special)["input_ids"]):
                ids[i] = row
    return texts, ids

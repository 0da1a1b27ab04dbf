"""A judge model as the reward: a vLLM engine reads each (prompt, response) in a template and
writes its verdict, which a parser turns into a score.

The engine is the generators' (``core.modeling.vllm_engine.start_engine``, sized by an EngineConfig),
sampling greedily by default. The template is a Python ``str.format`` string whose fields are
``prompt``, ``response`` (the pair being scored) and the prompt rows' other columns
(``{answer}``); a column itself named prompt or response is refused, as the template could not
tell it from the pair. With ``chat_template`` the rendered text becomes the user turn of the
judge tokenizer's chat template (``judge_token_ids``, which the driver's start-up probe runs
too). The parser: with ``choices`` (label -> score) the first label found in the output;
without, the first number in it, clipped to [min_score, max_score] when given. An output the
parser cannot read leaves its item invalid (one line per call counts them); nothing here
raises for what the judge wrote.
"""
from __future__ import annotations

import re
import time
from typing import Iterable, Mapping

import numpy as np

from actors.rewards.config import JudgeConfig, template_fields
from actors.rewards.scoring import Columns, ScoreResult, invalid_result
from core.modeling.vllm_engine import check_served, start_engine

RESPONSE_FIELDS = ("prompt", "response")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def check_columns(columns: Iterable[str], key: str = "reward.judge.template") -> None:
    """A one-line ValueError if a column is named like a field of the pair (prompt, response):
    ``str.format`` would get the name twice, and a template could not say which it means."""
    clash = sorted(set(columns) & set(RESPONSE_FIELDS))
    if clash:
        raise ValueError(f"the data has a column named {clash[0]!r}, which {key} cannot tell from the "
                         f"{clash[0]} being scored ({{{clash[0]}}}); rename that column in the data, or leave it "
                         "out of data.columns")


def check_template(template: str, columns: Iterable[str], key: str = "reward.judge.template") -> None:
    """A one-line ValueError if ``template`` is not valid, if a column clashes with prompt/response
    (check_columns), or if it names a field that is neither prompt/response nor one of ``columns``
    (the prompt rows' other fields)."""
    columns = list(columns)
    check_columns(columns, key)
    available = [*RESPONSE_FIELDS, *sorted(set(columns) - set(RESPONSE_FIELDS))]
    unknown = sorted(template_fields(template, key) - set(available))
    if unknown:
        raise ValueError(f"{key} names the field {', '.join(map(repr, unknown))}, which the data does not have "
                         f"(available: {', '.join(available)}); fix the template or add the column to the data")


def render(template: str, prompts: list[str], responses: list[str], columns: Columns) -> list[str]:
    """The judge's input text of each pair: the template filled with its prompt, response and columns."""
    check_columns(columns)  # a ValueError the scorer reports, not the TypeError of a repeated keyword
    return [template.format(**{k: v[i] for k, v in columns.items()}, prompt=p, response=r)
            for i, (p, r) in enumerate(zip(prompts, responses))]


def judge_token_ids(tokenizer, text: str, chat_template: bool) -> list[int]:
    """The ids the judge reads for ``text``: its tokens, or with ``chat_template`` the judge
    tokenizer's chat template around it as the user turn, the assistant's turn opened."""
    if chat_template:
        # Rendered to text, then tokenized: apply_chat_template(tokenize=True) returns a
        # BatchEncoding in transformers 5 (a list of ids in 4), and list() of it is its keys.
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def parse_number(text: str, min_score: float | None = None, max_score: float | None = None) -> float:
    """The first number in ``text``, clipped to [min_score, max_score] (either may be None); NaN if none."""
    m = _NUMBER.search(text)
    if m is None:
        return float("nan")
    x = float(m.group())
    return float(np.clip(x, -np.inf if min_score is None else min_score, np.inf if max_score is None else max_score))


def parse_choice(text: str, choices: Mapping[str, float]) -> float:
    """The score of the label that occurs first in ``text`` (the longer one at a tie); NaN if none does."""
    found = [(text.find(label), -len(label), label) for label in choices if label in text]
    return float(choices[min(found)[2]]) if found else float("nan")


def parse_verdicts(outputs: list[str], choices: Mapping[str, float] | None, min_score: float | None,
                   max_score: float | None, source: str) -> ScoreResult:
    """[N] outputs -> scores; an unreadable (or non-finite) one is invalid, one message counting them."""
    read = [parse_choice(t, choices) if choices else parse_number(t, min_score, max_score) for t in outputs]
    scores = np.asarray(read, dtype=np.float64).astype(np.float32)
    valid = np.isfinite(scores)
    errors = []
    if not valid.all():
        bad = np.flatnonzero(~valid)
        what = f"none of the labels {', '.join(map(repr, choices))}" if choices else "no number"
        errors.append(f"{source}: {bad.size} of {len(outputs)} verdicts had {what} (first at index {bad[0]}: "
                      f"{outputs[bad[0]][:80]!r}); those items are invalid")
    return ScoreResult(np.where(valid, scores, np.nan).astype(np.float32), valid, errors)


class JudgeScorer:
    """A TextScorer (actors/rewards/scoring.py) hosting the judge's vLLM engine in this process."""

    def __init__(self, config: JudgeConfig, *, dtype: str | None = None, seed: int = 0):
        """``config``: reward.judge with its model resolved to a path or a Hub name; ``dtype``: the
        engine's where reward.judge.engine.dtype is null (model.dtype for the reward pool)."""
        from dataclasses import replace

        model = config.model
        self.name = f"reward judge {model}"
        self.template, self.choices = config.template, dict(config.choices) if config.choices else None
        self.min_score, self.max_score = config.min_score, config.max_score
        self.chat_template = config.chat_template
        template_fields(self.template)
        engine = replace(config.engine, dtype=config.engine.dtype or dtype)
        self.max_model_len = engine.max_model_len
        check_served(model, "reward.judge.model")
        t0 = time.perf_counter()
        import torch
        self.llm = start_engine(model, engine, tensor_parallel=1, seed=seed, on_gpu=torch.cuda.is_available())
        self.start_seconds = time.perf_counter() - t0
        self.tokenizer = self.llm.get_tokenizer()
        from vllm import SamplingParams
        self.params = SamplingParams(temperature=config.temperature, max_tokens=config.max_new_tokens, seed=seed)
        self.dtype = str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")
        self.generated_tokens = 0

    def _token_ids(self, text: str) -> list[int]:
        return judge_token_ids(self.tokenizer, text, self.chat_template)

    def generate(self, texts: list[str]) -> tuple[list[int], list[str]]:
        """(the indices of the ``texts`` that fit the engine beside max_new_tokens, the judge's reply
        to each of those): one engine call for them all."""
        from vllm.inputs import TokensPrompt

        ids = [self._token_ids(t) for t in texts]
        room = self.max_model_len - self.params.max_tokens
        fits = [i for i, x in enumerate(ids) if 0 < len(x) <= room]
        if not fits:
            return [], []
        done = self.llm.generate([TokensPrompt(prompt_token_ids=ids[i]) for i in fits], self.params, use_tqdm=False)
        self.generated_tokens += sum(len(out.outputs[0].token_ids) for out in done)
        return fits, [out.outputs[0].text for out in done]

    def score_texts(self, prompts: list[str], responses: list[str], columns: Columns) -> ScoreResult:
        n = len(prompts)
        try:
            texts = render(self.template, prompts, responses, columns)
        except (KeyError, IndexError, AttributeError, TypeError, ValueError) as e:  # a column lacking or mis-shaped
            return invalid_result(n, f"{self.name}: cannot fill reward.judge.template ({type(e).__name__}: {e}); "
                                     f"all {n} items invalid")
        fits, replies = self.generate(texts)
        result = ScoreResult(np.full(n, np.nan, np.float32), np.zeros(n, bool))
        if fits:
            read = parse_verdicts(replies, self.choices, self.min_score, self.max_score, self.name)
            result.scores[fits], result.valid[fits], result.errors = read.scores, read.valid, read.errors
        if len(fits) < n:
            result.errors.insert(0, f"{self.name}: {n - len(fits)} of {n} rendered templates do not fit "
                                    f"reward.judge.engine.max_model_len={self.max_model_len} with max_new_tokens="
                                    f"{self.params.max_tokens}; those items are invalid (raise max_model_len)")
        return result

    def stats(self) -> dict:
        return {"judge_generated_tokens": self.generated_tokens, "dtype": self.dtype}

    def close(self) -> None:
        pass

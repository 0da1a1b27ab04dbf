"""reward.judge: a judge model as the reward (actors/judge.py), a section of its own."""
from __future__ import annotations

from typing import Optional

from actors.config import EngineConfig
from actors.judge import template_fields
from core.infra.schema import config_class, setting

# The built-in tiny judge's prompt (cluster/demo/judge.py trains on this very text).
DEFAULT_TEMPLATE = "Prompt: {prompt}\nResponse: {response}\nScore:"


@config_class
class JudgeConfig:
    """A judge model scoring each response: its vLLM engine, its prompt and how its verdict is read."""
    model: Optional[str] = setting(None, "the judge: a causal LM directory or Hub name, or builtin:judge (the "
                                         "offline tiny judge); null = no judge")
    template: str = setting(DEFAULT_TEMPLATE, "the judge's prompt, a Python format string: {prompt}, {response} "
                                              "and any column of the data ({answer}; a column named prompt or "
                                              "response is refused: rename it); a literal brace is {{ or }}")
    chat_template: bool = setting(False, "wrap the filled template as the user turn of the judge tokenizer's "
                                         "chat template (instruct judges)")
    choices: Optional[dict[str, float]] = setting(None, "read the verdict as the first of these labels in the "
                                                        "output, scored as given ({A: 1.0, B: 0.0}); null = the "
                                                        "first number in the output")
    min_score: Optional[float] = setting(None, "number verdicts below this are raised to it; null = no bound")
    max_score: Optional[float] = setting(None, "number verdicts above this are lowered to it; null = no bound")
    max_new_tokens: int = setting(8, "tokens the judge may write per verdict")
    temperature: float = setting(0.0, "0 = greedy: the same pair always gets the same verdict")
    engine: EngineConfig

    def __post_init__(self) -> None:
        template_fields(self.template)  # its syntax; its fields are checked against the data's columns
        if self.max_new_tokens < 1 or self.temperature < 0:
            raise ValueError("reward.judge.max_new_tokens must be >= 1 and reward.judge.temperature >= 0")
        if self.choices is not None and (not self.choices or "" in self.choices):
            raise ValueError("reward.judge.choices needs at least one non-empty label, e.g. {A: 1.0, B: 0.0}; "
                             "or null to read a number")
        if self.choices and (self.min_score is not None or self.max_score is not None):
            raise ValueError("reward.judge.min_score/max_score bound number verdicts; with choices, give each "
                             "label its score instead")
        if None not in (self.min_score, self.max_score) and self.min_score > self.max_score:
            raise ValueError(f"reward.judge.min_score={self.min_score} is above max_score={self.max_score}")
        if self.max_new_tokens >= self.engine.max_model_len:
            raise ValueError(f"reward.judge.max_new_tokens={self.max_new_tokens} leaves no room for the template in "
                             f"reward.judge.engine.max_model_len={self.engine.max_model_len}")

    def scorer_kwargs(self, model_path: str, dtype: str, seed: int) -> dict:
        """JudgeScorer's keyword arguments (actors/judge.py): ``model_path`` resolved, the engine's
        dtype ``dtype`` where reward.judge.engine.dtype is null (model.dtype for the reward pool)."""
        from dataclasses import replace
        return dict(model=model_path, template=self.template, choices=self.choices, min_score=self.min_score,
                    max_score=self.max_score, max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                    chat_template=self.chat_template, engine=replace(self.engine, dtype=self.engine.dtype or dtype),
                    seed=seed)


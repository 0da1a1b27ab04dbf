"""reasoning-gym's tasks scored by their own verifiers (``reward.function: actors.rewards:reasoning_gym``).

reasoning-gym generates verifiable tasks (arithmetic, logic, puzzles, ...) and scores an answer
to each with the task's own ``score_answer``. Prompt rows made by ``cluster.data.reasoning_gym``
carry the task's name (``rg_task``) and its generated entry (``rg_entry``, JSON: the answer and
the metadata the verifier reads); each response's answer is what it puts between
``<answer>`` and ``</answer>``, as reasoning-gym's prompts ask, else its whole text stripped.
Needs the ``reasoning-gym`` package (the ``envs`` extra).
"""
from __future__ import annotations

import functools
import json


@functools.lru_cache(maxsize=None)
def _scorer(task: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


def reasoning_gym(prompts: list[str], responses: list[str], *, rg_task: list[str], rg_entry: list[str]) -> list[float]:
    """Each response's score by its row's task's verifier, in [0, 1]."""
    from reasoning_gym.utils import extract_answer

    if not len(prompts) == len(responses) == len(rg_task) == len(rg_entry):
        raise ValueError(f"reasoning_gym: {len(prompts)} prompts, {len(responses)} responses, {len(rg_task)} tasks, "
                         f"{len(rg_entry)} entries")
    out = []
    for response, task, entry in zip(responses, rg_task, rg_entry):
        answer = extract_answer(response) or response.strip()
        out.append(float(_scorer(task)(answer, json.loads(entry) if isinstance(entry, str) else entry)))
    return out

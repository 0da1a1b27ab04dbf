"""A demo task with answers: small sums and differences ("3 plus 4 is" -> "7").

The sentiment demo's reward is a judgement; this task's is a check against a reference answer,
as verifiable-reward RL (math, code) has. Everything it needs lives here:
- the facts: every "a plus b" and "a minus b" (b <= a) of the digits 0-5, 57 in all, in two
  sources, "add" (36) and "sub" (21);
- ``corpus``: true sentences about them, mostly true negatives ("3 plus 4 is not 5."), so the
  policy pre-trained on it (``build_arithmetic_policy``) knows the facts but answers only about
  a third of the time;
- ``prompt_rows``: the RL rows {"prompt", "answer", "source"} (``--write`` saves them as jsonl);
- ``exact``: the verifier, ``f(prompts, responses, *, answer) -> floats``, 1.0 where the
  response is the answer (a number, optionally followed by a full stop) and 0.0 otherwise;
- ``reward_from_prompt``: the same check with the answer worked out from the prompt text, for a
  2-argument ``reward.function`` (cluster.demo.arithmetic:reward_from_prompt);
- ``SecondChance``: the task as a two-turn episode, a wrong answer asked again
  (env.environment=cluster.demo.arithmetic:SecondChance, configs/arith-episodes-tiny.yaml);
- ``BUILTIN`` (builtin:arith): a config's name for both, ``model.policy: builtin:arith`` the
  pre-trained policy and ``data.path: builtin:arith`` the prompt rows, each built on first use
  and cached (``build_arithmetic_policy``, ``build_prompt_file``).

A verifier that reads the last number (e.g. Math-Verify) scores "not 5." as 5: wrong too, as
it should be. RL has to learn to answer instead of hedging, which the ~1M-parameter policy does
in a few dozen GRPO steps on CPU (configs/arith-tiny.yaml, which names both by BUILTIN).
Copies to look at or edit (not needed to run the configs):

    python -m cluster.demo.arithmetic --write runs/arith/prompts.jsonl --policy runs/arith/policy
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import shutil
import sys
from pathlib import Path

BUILTIN = "builtin:arith"  # model.policy and data.path: the task's policy and prompt rows, built and cached
OPERATIONS = {"plus": ("add", lambda a, b: a + b), "minus": ("sub", lambda a, b: a - b)}
DIGITS = range(0, 6)  # operands: small enough that ~1M parameters learn every fact in ~1 min
NUMBERS = range(0, 11)  # every answer (the largest is 5 plus 5)
# Share of corpus sentences that state the answer ("3 plus 4 is 7."); the others state a true
# negative ("3 plus 4 is not 5."). The pre-trained policy knows the facts but hedges with "not"
# about as often: a choice that does not depend on the prompt, which RL unlearns in a few steps.
P_ANSWER = 0.3
PROMPT = re.compile(r"^\s*(\d+) (plus|minus) (\d+) is\s*$")
ANSWER = re.compile(r"^\s*(-?\d+)\.?\s*$")


def facts() -> list[tuple[str, str, int]]:
    """(prompt, source, answer) for every sum and non-negative difference of two DIGITS."""
    out = []
    for word, (source, op) in OPERATIONS.items():
        for a in DIGITS:
            for b in DIGITS:
                if op(a, b) >= 0:
                    out.append((f"{a} {word} {b} is", source, op(a, b)))
    return out


def corpus(n_sentences: int = 6000, seed: int = 0) -> list[str]:
    """Deterministic true sentences over the facts, each fact about equally often: "<a> plus|minus
    <b> is <answer>." with probability P_ANSWER, else "... is not <n>." with n another of NUMBERS."""
    rng = random.Random(seed)
    table = facts()
    lines = []
    for _ in range(n_sentences):
        prompt, _source, answer = rng.choice(table)
        if rng.random() < P_ANSWER:
            lines.append(f"{prompt} {answer}.")
        else:
            lines.append(f"{prompt} not {rng.choice([n for n in NUMBERS if n != answer])}.")
    return lines


def prompt_rows(n: int | None = None, seed: int = 0) -> list[dict]:
    """The RL rows {"prompt": "3 plus 4 is", "answer": "7", "source": "add"}, shuffled by
    `seed`: every fact once (n=None), or the first n of them (n above 155 repeats the facts)."""
    table = facts()
    random.Random(seed).shuffle(table)
    n = len(table) if n is None else n
    if n < 1:
        raise ValueError(f"prompt_rows: n must be >= 1, got {n}")
    return [{"prompt": p, "answer": str(a), "source": s} for p, s, a in (table[i % len(table)] for i in range(n))]


def is_answer(response: str, answer: str) -> bool:
    """The response is the answer: one integer equal to it, optionally followed by a full stop."""
    m = ANSWER.match(response)
    return m is not None and int(m.group(1)) == int(answer)


def exact(prompts: list[str], responses: list[str], *, answer: list[str], **_columns) -> list[float]:
    """1.0 where the response is the row's reference answer, else 0.0 (other columns ignored)."""
    if not len(prompts) == len(responses) == len(answer):
        raise ValueError(f"exact: {len(prompts)} prompts, {len(responses)} responses, {len(answer)} answers")
    return [1.0 if is_answer(r, a) else 0.0 for r, a in zip(responses, answer)]


def well_formed(prompts: list[str], responses: list[str]) -> list[float]:
    """1.0 where the response has an answer's form (one integer, optionally a full stop), right or
    wrong, else 0.0: configs/arith-composed-tiny.yaml's format source."""
    return [1.0 if ANSWER.match(r) else 0.0 for r in responses]


def response_chars(prompts: list[str], responses: list[str]) -> list[float]:
    """Each response's length in characters: configs/arith-composed-tiny.yaml's monitor (weight 0)."""
    return [float(len(r)) for r in responses]


def answer_of(prompt: str) -> str:
    """The reference answer of a prompt of this task, worked out from its text."""
    m = PROMPT.match(prompt)
    if m is None:
        raise ValueError(f"not an arithmetic prompt: {prompt!r} (expected '<a> plus|minus <b> is')")
    a, word, b = m.groups()
    return str(OPERATIONS[word][1](int(a), int(b)))


def reward_from_prompt(prompts: list[str], responses: list[str]) -> list[float]:
    """``exact`` with each answer worked out from its prompt: a 2-argument reward.function."""
    return exact(prompts, responses, answer=[answer_of(p) for p in prompts])


class SecondChance:
    """The task as a two-turn episode (an environment, actors/environments/base.py): a right first
    answer scores 1.0; a wrong one is told so by the question asked again, and a right second
    answer scores 0.5. The policy pre-trained on the corpus hedges ("not 5.") about two times in
    three, so an episode starts out taking ~1.7 turns; RL raises the score and brings the turns
    towards 1 (configs/arith-episodes-tiny.yaml)."""
    SECOND_TRY = 0.5

    def reset(self, prompt: str, columns: dict) -> None:
        self.question, self.turn = prompt.strip(), 0
        self.answer = str(columns.get("answer") or answer_of(self.question))
        return None

    def step(self, action: str):
        self.turn += 1
        if is_answer(action, self.answer):
            return None, 1.0 if self.turn == 1 else self.SECOND_TRY, True, {}
        return (self.question, 0.0, False, {}) if self.turn == 1 else (None, 0.0, True, {})


def second_chance_agent(prompt: str, columns: dict, *, client) -> float:
    """SecondChance as an agent (env.agent, docs/guide/agents.md): it asks the policy through the
    OpenAI completions API, and after a wrong answer asks again with the question repeated after
    it; 1.0 for a right first answer, 0.5 for a right second one (configs/arith-agent-tiny.yaml)."""
    answer = str(columns.get("answer") or answer_of(prompt))
    first = client.completions.create(model="policy", prompt=prompt).choices[0].text
    if is_answer(first, answer):
        return 1.0
    second = client.completions.create(model="policy", prompt=prompt + first + prompt.strip()).choices[0].text
    return SecondChance.SECOND_TRY if is_answer(second, answer) else 0.0


# Pre-training recipe of the task's policy: the tiny Qwen2 of cluster.demo.tiny_models (the
# sentiment tokenizer: digits are byte tokens of its alphabet), trained on `corpus()`.
PRETRAIN_STEPS = 1000
PRETRAIN_BATCH = 64
PRETRAIN_LR = 3e-3


def build_arithmetic_policy() -> Path:
    """The tiny policy pre-trained on this task's corpus (cached like the default's)."""
    from cluster.demo.pretrain import build_pretrained_policy

    return build_pretrained_policy(steps=PRETRAIN_STEPS, batch_size=PRETRAIN_BATCH, lr=PRETRAIN_LR,
                                   texts=corpus())


def write_rows(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


PROMPT_FILE = "prompts.jsonl"


def build_prompt_file() -> Path:
    """Every prompt row as jsonl in the cache (cluster.demo.tiny_models.cache_root), under a key
    of the rows' content: written into a folder of its own and renamed into place, so two
    processes building it at once never read half a file."""
    from cluster.demo.tiny_models import cache_root
    from core.infra.files import publish_dir

    rows = prompt_rows()
    key = hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]
    folder = cache_root() / f"arith-prompts-{key}"
    if not (folder / PROMPT_FILE).is_file():
        with publish_dir(folder, shared=True) as tmp:
            write_rows(tmp / PROMPT_FILE, rows)
    return folder / PROMPT_FILE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.demo.arithmetic", description=__doc__.split("\n")[0])
    parser.add_argument("--write", metavar="PATH", help="write every prompt row as jsonl (prompt, answer, source)")
    parser.add_argument("--policy", metavar="DIR", help="copy the task's pre-trained policy here (built if needed)")
    args = parser.parse_args(argv)
    if not (args.write or args.policy):
        parser.error("nothing to do: give --write PATH and/or --policy DIR")
    if args.write:
        write_rows(Path(args.write), prompt_rows())
        print(f"wrote {len(facts())} prompt rows to {args.write}")
    if args.policy:
        shutil.copytree(build_arithmetic_policy(), args.policy, dirs_exist_ok=True)
        print(f"pre-trained arithmetic policy in {args.policy}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

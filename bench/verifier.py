"""Verifier throughput: actors.rewards:math in the replica's process vs in reward.sandbox workers.

    .venv/bin/python -m bench.verifier --pairs 512

Scores the same GSM8K-like (response, answer) pairs (a worked solution ending in a final
answer, half of them right, every one distinct so Math-Verify's parse cache does not help) the
three ways a replica can (in this process through FunctionScorer; in 1 and 2 sandbox workers)
and prints pairs/s side by side. The sandbox's start-up (worker imports) is not in the figure.
"""
from __future__ import annotations

import argparse
import random
import time

from actors.rewards.config import RewardConfig, SandboxConfig
from actors.rewards.source import configured_source

SPEC = "actors.rewards:math"


def gsm8k_like(n: int, seed: int = 0) -> tuple[list[str], list[str], list[str]]:
    """(prompts, responses, answers): distinct word problems, solutions and gold solutions ending in #### x."""
    rng = random.Random(seed)
    prompts, responses, answers = [], [], []
    for i in range(n):
        a, b, c = rng.randint(2, 900), rng.randint(2, 90), rng.randint(2, 9)
        total = a * c + b
        said = total if i % 2 == 0 else total + rng.randint(1, 9)
        prompts.append(f"Sam buys {c} boxes of {a} pens and {b} loose pens. How many pens does Sam have?")
        end = rng.choice([f"The answer is \\boxed{{{said:,}}}.", f"#### {said}", f"So Sam has {said} pens."])
        responses.append(f"Each box holds {a} pens, so {c} boxes hold {c} * {a} = {a * c} pens. Adding the {b} "
                         f"loose pens gives {a * c} + {b} = {said}.\n{end}")
        answers.append(f"{c} * {a} = <<{c}*{a}={a * c}>>{a * c}\n{a * c} + {b} = <<{a * c}+{b}={total}>>{total}\n"
                       f"#### {total:,}")
    return prompts, responses, answers


def pairs_per_s(sandbox: SandboxConfig, prompts, responses, answers) -> tuple[float, float]:
    """(pairs/s, share scored 1.0) of one scorer over all the pairs, after a warm-up pair."""
    config = RewardConfig(function=SPEC, timeout_s=600, sandbox=sandbox)
    scorer = configured_source(config).text_scorer(config)
    try:
        scorer.score_texts(prompts[:1], responses[:1], {"answer": answers[:1]})  # imports, first parse
        start = time.perf_counter()
        res = scorer.score_texts(prompts, responses, {"answer": answers})
        seconds = time.perf_counter() - start
    finally:
        scorer.close()
    return len(prompts) / seconds, float(res.scores[res.valid].mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=512)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    data = gsm8k_like(args.pairs)
    rows = [("in-process", SandboxConfig())] + [(f"sandbox x{w}", SandboxConfig(workers=w, timeout_s=10.0,
                                                                                  memory_mb=1024))
                                     for w in args.workers]
    print(f"{SPEC} on {args.pairs} GSM8K-like pairs")
    for label, sandbox in rows:
        rate, right = pairs_per_s(sandbox, *data)
        print(f"  {label:<12} {rate:8.0f} pairs/s   (mean score {right:.2f})")


if __name__ == "__main__":
    main()

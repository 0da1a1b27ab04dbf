"""Prompt rows of a reasoning-gym task, scored by its own verifier (actors.rewards:reasoning_gym).

    python -m cluster.data.reasoning_gym --task basic_arithmetic --size 2000 --seed 0 --out rows.jsonl

Each row: ``prompt`` (the generated question), ``answer``, and the columns the verifier reads,
``rg_task`` and ``rg_entry`` (the whole generated entry as JSON). Train on them with
``data.path: rows.jsonl`` and ``reward.function: actors.rewards:reasoning_gym``. Needs the
``reasoning-gym`` package (the ``envs`` extra).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def task_rows(task: str, *, size: int, seed: int = 0, suffix: str = "") -> list[dict]:
    """``size`` rows of reasoning-gym's ``task`` (its generator seeded by ``seed``); ``suffix``
    follows each question (e.g. how to format the answer)."""
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError("reasoning-gym is not installed: pip install 'tether[envs]'") from None
    try:
        dataset = reasoning_gym.create_dataset(task, size=size, seed=seed)
    except Exception as e:  # noqa: BLE001 - an unknown task name is the user's to fix
        raise ValueError(f"reasoning-gym has no task {task!r} ({type(e).__name__}); see "
                         f"reasoning_gym.factory.DATASETS for the names") from None
    return [{"prompt": entry["question"] + suffix, "answer": str(entry["answer"]), "rg_task": task,
             "rg_entry": json.dumps(entry, default=str)} for entry in dataset]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cluster.data.reasoning_gym", description=__doc__.split("\n")[0])
    ap.add_argument("--task", required=True, help="a reasoning-gym task name, e.g. basic_arithmetic")
    ap.add_argument("--size", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--suffix", default="", help="text after each question")
    ap.add_argument("--out", required=True, help="the .jsonl file to write")
    args = ap.parse_args(argv)
    try:
        rows = task_rows(args.task, size=args.size, seed=args.seed, suffix=args.suffix)
    except ValueError as e:
        print(f"error: {e}", flush=True)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} rows of {args.task} to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The task with answers (cluster/demo/arithmetic.py, configs/arith-tiny.yaml): GRPO against the
built-in math verifier, which reads each prompt's `answer` column in a sandbox, raises the share of
right answers of the policy pre-trained on the task (the config's builtin:arith, built on first use
and cached, as the prompt rows are)."""
import json

import pytest

from cluster import train
from cluster.config.ppo import CONFIGS

pytestmark = pytest.mark.e2e


def test_grpo_learns_to_answer(cluster, tmp_path):
    # builtin:arith: cached; the policy takes ~1-2 min on 2 cores the first time
    argv = ["--config", str(CONFIGS / "arith-tiny.yaml"), f"run.dir={tmp_path}", "run.name=arith",
            "run.plot_every=0", "run.checkpoint_every=0"]
    assert train.main(argv) == 0
    rows = [json.loads(line) for line in (tmp_path / "arith" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert len(steps) == 40 and all(m["rollouts/invalid_scores"] == 0 for m in steps)
    # Window means (steps of 128 rollouts each), not single steps: the success rate of one step
    # swings by ~0.1 with the prompts it draws. It rises from the first steps on, so the first
    # window is short.
    first = sum(m["reward/mean"] for m in steps[:4]) / 4
    last = sum(m["reward/mean"] for m in steps[-10:]) / 10
    evals = [r["eval/score_mean"] for r in rows if "eval/score_mean" in r]
    print(f"arithmetic: success first 4 steps {first:.3f} -> last 10 steps {last:.3f}; eval {evals}")
    assert 0.1 < first < 0.5  # the pre-trained policy answers, right, about a third of the time
    assert last > first + 0.3 and last > 0.7
    assert len(evals) == 5 and evals[-1] > evals[0] + 0.3  # held-out prompts, every 10 steps
    # The rows' `source` column: the reward of each kind of question, every step.
    assert all(m["reward/add/count"] + m["reward/sub/count"] == m["rollouts/used"] for m in steps)
    assert sum(m["reward/sub/mean"] for m in steps[-10:]) / 10 > 0.7
    samples = [json.loads(line) for line in (tmp_path / "arith" / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["columns"]["source"] in ("add", "sub") and s["columns"]["answer"] for s in samples)
    share = [m["perf/score_seconds"] / m["perf/step_seconds"] for m in steps]
    print(f"arithmetic: scoring's share of a step, median {sorted(share)[len(share) // 2]:.3f}")

"""The task with answers (cluster/demo/arithmetic.py, configs/arith-tiny.yaml): GRPO against the
built-in math verifier, which reads each prompt's `answer` column in a sandbox, raises the share of
right answers of the policy pre-trained on the task (the config's builtin:arith, built on first use
and cached, as the prompt rows are)."""
import json

import pytest

from cluster import train
from cluster.config.ppo import CONFIGS

pytestmark = pytest.mark.e2e


def run_arith(tmp_path, *overrides) -> tuple[list[dict], list[dict]]:
    """The config's run (builtin:arith is cached; the policy takes ~1-2 min on 2 cores the first
    time) -> its metrics rows and samples."""
    argv = ["--config", str(CONFIGS / "arith-tiny.yaml"), f"run.dir={tmp_path}", "run.name=arith",
            "run.plot_every=0", "run.checkpoint_every=0", *overrides]
    assert train.main(argv) == 0
    rows = [json.loads(line) for line in (tmp_path / "arith" / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (tmp_path / "arith" / "samples.jsonl").read_text().splitlines()]
    return rows, samples


def check_columns(steps: list[dict], samples: list[dict]) -> None:
    """The rows' `source` and `answer` columns: the reward of each kind of question every step,
    and both columns beside each dumped sample."""
    assert all(m["rollouts/invalid_scores"] == 0 for m in steps)
    assert all(m["reward/add/count"] + m["reward/sub/count"] == m["rollouts/used"] for m in steps)
    assert samples and all(s["columns"]["source"] in ("add", "sub") and s["columns"]["answer"] for s in samples)


def success(rows: list[dict], head: int, tail: int) -> tuple[list[dict], float, float, list[float]]:
    """The steps' rows; the mean success of the first ``head`` and the last ``tail`` steps (window
    means: one step's rate swings by ~0.1 with the prompts it draws); the eval scores."""
    steps = [r for r in rows if r["step"] > 0]
    first = sum(m["reward/mean"] for m in steps[:head]) / head
    last = sum(m["reward/mean"] for m in steps[-tail:]) / tail
    evals = [r["eval/score_mean"] for r in rows if "eval/score_mean" in r]
    print(f"arithmetic: success first {head} steps {first:.3f} -> last {tail} steps {last:.3f}; eval {evals}")
    return steps, first, last, evals


def test_grpo_learns_to_answer(cluster, tmp_path):
    rows, samples = run_arith(tmp_path, "run.steps=10", "run.eval_every=5")
    steps, first, last, evals = success(rows, 3, 3)
    assert len(steps) == 10
    check_columns(steps, samples)
    # generator.sampling.seed=data.seed=run.seed 0, 1, 2: first 3 -> last 3 steps +0.28, +0.22,
    # +0.25; eval at step 0 -> step 10 +0.33, +0.38, +0.31.
    assert 0.1 < first < 0.5  # the pre-trained policy answers, right, about a third of the time
    assert last > first + 0.1
    assert len(evals) == 3 and evals[-1] > evals[0] + 0.15  # held-out prompts, at steps 0, 5, 10


# The slow tier: the full curve docs/guide/rewards.md quotes. The default tier: the rise, its columns and
# samples in test_grpo_learns_to_answer above.
@pytest.mark.slow
def test_grpo_answers_most_prompts_after_the_configs_40_steps(cluster, tmp_path):
    rows, samples = run_arith(tmp_path)
    steps, first, last, evals = success(rows, 4, 10)
    assert len(steps) == 40
    check_columns(steps, samples)
    # It rises from the first steps on, so the first window is short. Seeds 0, 1, 2 (as above): first 4 steps
    # 0.27, 0.25, 0.29 -> last 10 0.75, 0.77, 0.72; eval +0.44, +0.39, +0.40; subtraction's last 10 0.81, 0.85, 0.82.
    assert 0.1 < first < 0.5
    assert last > first + 0.3 and last > 0.65
    assert len(evals) == 5 and evals[-1] > evals[0] + 0.3  # held-out prompts, every 10 steps
    assert sum(m["reward/sub/mean"] for m in steps[-10:]) / 10 > 0.7
    share = [m["perf/score_seconds"] / m["perf/step_seconds"] for m in steps]
    print(f"arithmetic: scoring's share of a step, median {sorted(share)[len(share) // 2]:.3f}")

"""A critic-free estimator through the whole service: GRPO with the KL in the loss learns the
default task with no value model anywhere, and a run resumes from its checkpoint."""
import json
from pathlib import Path

import pytest

from cluster import train

pytestmark = pytest.mark.e2e


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_grpo_learns_without_a_critic_and_resumes(cluster, tmp_path):
    args = [f"run.dir={tmp_path}", "run.name=grpo", "run.eval_every=12", "run.checkpoint_every=6",
            "ppo.advantage=grpo", "ppo.kl.placement=loss", "ppo.kl.estimator=k3"]
    assert train.main([*args, "run.steps=12"]) == 0
    run_dir = tmp_path / "grpo"
    steps = [m for m in metrics(run_dir) if m["step"] > 0]
    for m in steps:
        assert "ppo/value_loss" not in m and "ppo/explained_variance" not in m and "ppo/values_mean" not in m
        assert 0 <= m["advantage/zero_frac"] < 1 and m["advantage/abs_mean"] > 0
    # the learner weighs the KL loss with the beta the controller left after the step before
    assert [m["ppo/kl_loss_coef"] for m in steps[1:]] == pytest.approx([m["kl/beta"] for m in steps[:-1]])
    final = run_dir / "checkpoints" / "final"
    assert (final / "config.json").exists() and not (final / "value_head.safetensors").exists()
    first = sum(m["reward/mean"] for m in steps[:3]) / 3
    last = sum(m["reward/mean"] for m in steps[-3:]) / 3
    evals = [m["eval/score_mean"] for m in metrics(run_dir) if "eval/score_mean" in m]
    print(f"grpo: reward first 3 steps {first:.3f} -> last 3 steps {last:.3f}; eval {evals}")
    assert last > first + 0.3 and evals[-1] > evals[0] + 0.3

    # Resume the finished run for two more steps: the learner state (no value model) loads.
    assert train.main([*args, "run.steps=14", "run.resume=auto"]) == 0
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "succeeded" and status["resumed_from_step"] == 12
    assert [m["step"] for m in metrics(run_dir) if m["step"] > 12] == [13, 14]

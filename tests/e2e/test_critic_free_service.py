"""A critic-free estimator through the whole service: GRPO with the KL in the loss learns the
default task with no value model anywhere, and a run resumes from its checkpoint."""
import json
from pathlib import Path

import pytest

from cluster import train

pytestmark = pytest.mark.e2e


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# The slow tier. The default tier: GRPO learns in tests/e2e/test_arithmetic_task.py::test_grpo_learns_to_answer,
# the critic-free resume in tests/learner/objectives/test_critic_free_update.py::
# test_one_rank_critic_free_update_matches_plain_torch.
@pytest.mark.slow
def test_grpo_learns_without_a_critic_and_resumes(cluster, tmp_path):
    # bf16, as users run it where the CPU has it: the learning margin below is that precision's
    args = [f"run.dir={tmp_path}", "run.name=grpo", "run.eval_every=12", "run.checkpoint_every=6",
            "ppo.advantage=grpo", "ppo.kl.placement=loss", "ppo.kl.estimator=k3", "model.dtype=bfloat16"]
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


def test_dynamic_sampling_trains_no_flat_prompt_and_refills_the_step(cluster, tmp_path):
    """RLOO on a pass/fail reward with ppo.filter_groups, over two learner ranks: prompts whose 4
    samples all passed or all failed never reach the learner (not one token with a zero
    advantage), the steps that lost some drew further prompt batches, up to the cap, to refill to
    exactly one batch, and the ranks train on it with no value model anywhere (the group
    statistics over both ranks' rows)."""
    args = [f"run.dir={tmp_path}", "run.name=dapo", "run.steps=3", "run.eval_every=0", "run.plot_every=0",
            "reward.function=cluster.demo.sentiment:is_positive", "ppo.advantage=rloo", "learner.replicas=2",
            "ppo.kl.placement=loss", "ppo.kl.estimator=k3", "ppo.filter_groups=true", "ppo.filter_max_batches=3",
            "model.dtype=bfloat16"]  # which groups tie depends on the precision the responses were sampled at
    assert train.main(args) == 0
    run_dir = tmp_path / "dapo"
    assert json.loads((run_dir / "status.json").read_text())["state"] == "succeeded"
    steps = [m for m in metrics(run_dir) if m["step"] > 0]
    assert [m["learner/step"] for m in steps] == [1, 2, 3]
    full = 16 * 4
    for m in steps:
        assert "ppo/value_loss" not in m and "ppo/explained_variance" not in m
        assert m["advantage/zero_frac"] == 0.0 and m["advantage/abs_mean"] > 0, m
        assert m["rollouts/used"] > 0 and m["learner/tokens"] > 0
        assert 0 <= m["rollouts/filtered_frac"] <= 1
        drawn = m["rollouts/prompts"] // 16
        assert m["rollouts/extra_generated"] == (drawn - 1) * full and 1 <= drawn <= 3
        # refilled to exactly one batch of whole prompts (the rest left out), or stopped at the cap
        assert m["rollouts/used"] == full or (drawn == 3 and m["rollouts/used"] < full), m
        assert m["rollouts/surplus"] % 4 == 0 and (m["rollouts/surplus"] == 0 or drawn > 1), m
    print("dapo: filtered", [round(m["rollouts/filtered_frac"], 2) for m in steps],
          "batches", [m["rollouts/prompts"] // 16 for m in steps], "used", [m["rollouts/used"] for m in steps])
    # Seen by step 2 at generator.sampling.seed=data.seed=run.seed 0, 1 and 2 (filtered share at steps 1-3:
    # 0/.12/.09, .19/.19/.19, 0/.09/.19; each step from 2 on refilled and overshot), so 3 steps leave a spare.
    assert any(m["rollouts/filtered_frac"] > 0 for m in steps)
    assert any(m["rollouts/extra_generated"] > 0 for m in steps)
    assert any(m["rollouts/surplus"] > 0 for m in steps)  # a refill overshot, and the overshoot was left out


# rloo over two learner ranks trains in the default tier, with dynamic sampling, in the test above.
@pytest.mark.parametrize("estimator, overrides", [
    pytest.param("reinforce_pp", ["learner.replicas=2"], marks=pytest.mark.slow),
    # the slow tier: variants of the one above; the default tier: their math in tests/core/test_estimators.py,
    # their updates in tests/learner/objectives/test_critic_free_update.py
    # (test_one_rank_critic_free_update_matches_plain_torch)
    pytest.param("reinforce_pp_baseline", [], marks=pytest.mark.slow),
    pytest.param("grpo", ["ppo.group_std=false"], marks=pytest.mark.slow),  # Dr. GRPO: no division by the std
], ids=["reinforce_pp-2-ranks", "reinforce_pp_baseline", "dr-grpo"])
def test_every_critic_free_estimator_trains_through_the_service(cluster, tmp_path, estimator, overrides):
    """Each estimator by name, from the config through the driver to the learner ranks (two
    for reinforce_pp: batch statistics over both ranks' rows): the run
    finishes, no value model anywhere, and the advantages it trained on are not all zero."""
    name = f"{estimator}-{len(overrides)}"
    args = [f"run.dir={tmp_path}", f"run.name={name}", "run.steps=3", "run.eval_every=0", "run.plot_every=0",
            f"ppo.advantage={estimator}", "model.dtype=bfloat16", *overrides]
    assert train.main(args) == 0
    run_dir = tmp_path / name
    assert json.loads((run_dir / "status.json").read_text())["state"] == "succeeded"
    steps = [m for m in metrics(run_dir) if m["step"] > 0]
    assert [m["learner/step"] for m in steps] == [1, 2, 3]
    for m in steps:
        assert "ppo/value_loss" not in m and "ppo/explained_variance" not in m
        assert m["advantage/abs_mean"] > 0 and 0 <= m["advantage/zero_frac"] < 1, m
        assert m["rollouts/used"] > 0 and m["learner/tokens"] > 0

"""Three PPO steps of the whole service with each model family as policy, reference and reward
model (the family's sequence classifier): every pool loads the family, the learner's weights
reach vLLM after each step, and the run completes. A family vLLM does not serve is refused
before the run starts, in one line, exit 2."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cluster import train
from cluster.demo.families import FAMILIES, build_family_policy, build_family_reward

REPO = Path(__file__).resolve().parents[2]
# The default tier runs the families with the most of their own (soft-capping, a tied head, sliding
# windows; vLLM's Transformers backend); the others are slow: their weight path is checked by default.
DEFAULT_TIER = ("gemma2", "gpt-neox")


@pytest.mark.e2e
@pytest.mark.parametrize("family", [f if f in DEFAULT_TIER else pytest.param(f, marks=pytest.mark.slow)
                                    for f in FAMILIES])
def test_three_ppo_steps(cluster, tmp_path, family):
    argv = [f"run.dir={tmp_path}", "run.name=ppo", f"model.policy={build_family_policy(family)}",
            f"reward.model={build_family_reward(family)}", "reward.function=null", "run.steps=3",
            "run.eval_every=0", "run.samples_every=0", "run.plot_every=0", "data.prompts_per_step=8",
            "model.dtype=float32"]  # the family's push is checked to 1e-3, which bf16's rounding alone exceeds
    assert train.main(argv) == 0
    run_dir = tmp_path / "ppo"
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "succeeded"
    assert set(status["dtypes"].values()) == {"float32", "float32 (master weights float32)"}
    assert status["dtypes"]["reward-0"] == "float32"  # the reward model reports what it loaded
    steps = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if m["step"] > 0]
    print(f"family-table {family} PPO: 3 steps, logprob gap {max(m['ppo/logprob_gap_mean'] for m in steps):.1e}, "
          f"reward {[round(m['reward/mean'], 3) for m in steps]}")
    assert [m["step"] for m in steps] == [1, 2, 3]
    # Sync mode: every step trains on rollouts of the weights pushed after the step before.
    assert all(m["ppo/logprob_gap_mean"] < 1e-3 for m in steps)
    assert all(np.isfinite(m["reward/mean"]) and m["rollouts/invalid_scores"] == 0 for m in steps)
    assert len({m["reward/mean"] for m in steps}) > 1, "the family's reward model scores what is sampled"


def train_cli(family: str, run_dir: Path) -> subprocess.CompletedProcess:
    """`python -m cluster.train` on ``family``'s tiny policy, in a Ray of its own."""
    return subprocess.run(
        [sys.executable, "-m", "cluster.train", f"model.policy={build_family_policy(family)}",
         f"run.dir={run_dir}", f"run.name={family}"], cwd=REPO, text=True, capture_output=True, timeout=600,
        env={**os.environ, "RAY_ADDRESS": ""})


@pytest.mark.e2e
@pytest.mark.slow  # a whole start-up until the generator refuses; check_served's own test is in test_family_scorers
def test_a_family_vllm_does_not_serve_is_refused_in_one_line(tmp_path):
    result = train_cli("gpt-neo", tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    [line] = [ln for ln in result.stderr.splitlines() if ln.startswith("tether:")]
    assert line.startswith("tether: error: model.policy: vLLM ") and "GPTNeoForCausalLM" in line
    assert "Traceback" not in result.stderr
    status = json.loads((tmp_path / "gpt-neo" / "status.json").read_text())
    assert status["state"] == "failed" and "GPTNeoForCausalLM" in status["reason"]


@pytest.mark.integration
def test_a_model_that_is_no_causal_lm_is_refused_before_ray_starts(tmp_path):
    result = train_cli("bert", tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "tether: error: model.policy: architecture BertForMaskedLM is not a text causal LM that transformers' "
        "AutoModelForCausalLM loads; tether trains decoder-only causal LMs (e.g. LlamaForCausalLM, "
        "Qwen2ForCausalLM): use such a checkpoint"]
    assert not (tmp_path / "bert").exists(), "refused before the run folder is made"

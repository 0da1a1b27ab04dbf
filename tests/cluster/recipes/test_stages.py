"""The SFT and reward-model stages through their real entrypoints (subprocesses, local Ray,
DeepSpeed on CPU), on 1 and 2 learner ranks, with tiny data sets written here; and what PPO
does with their outputs (model.policy, reward.model + reward.normalize, reference.model)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from reward_configs import reward_config

from cluster.demo.sentiment import builtin_rows

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[3]
CHANCE = 0.5
MIN_ACCURACY = 0.8  # held-out pair accuracy the reward model must reach: chance + 0.3 (measured 1.0)
COMMON = ["data.max_seq_len=32", "data.eval_examples=16", "train.batch_size=8", "train.micro_batch_size=4",
          "learner.optim.lr=0.001", "learner.optim.warmup_steps=2", "resources.num_cpus=4"]


def cli(module: str, *args, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_ADDRESS": "", "DS_ACCELERATOR": "cpu"}
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO, text=True,
                          capture_output=True, timeout=timeout, env=env)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_sft(tmp: Path, name: str, replicas: int, *overrides) -> Path:
    data = write_jsonl(tmp / f"{name}.jsonl", builtin_rows("sft", 112, seed=1))
    r = cli("cluster.sft", f"run.dir={tmp}", f"run.name={name}", f"data.path={data}", "train.epochs=2",
            f"learner.replicas={replicas}", *COMMON, *overrides)
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / name


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory) -> Path:
    return run_sft(tmp_path_factory.mktemp("sft"), "sft-1", 1, "run.trackers=[mlflow]", "run.tracking.group=stages")


def check_sft(run_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    rows = metrics(run_dir)
    loss = [r["sft/loss"] for r in rows if "sft/loss" in r]
    evals = [r["sft/eval_loss"] for r in rows if "sft/eval_loss" in r]
    print(f"{run_dir.name}: sft/loss {loss[0]:.3f} -> {loss[-1]:.3f}, eval {evals}")
    assert len(loss) == 2 * (96 // 8) and len(evals) == 3  # 96 training rows, 2 epochs; eval before + per epoch
    assert np.mean(loss[-3:]) < np.mean(loss[:3]) - 0.1 and evals[-1] < evals[0] - 0.1
    final = run_dir / "checkpoints" / "final"
    assert json.loads((run_dir / "status.json").read_text())["state"] == "succeeded"
    assert json.loads((final / "tether_stage.json").read_text())["stage"] == "sft"
    assert not (final / "value_head.safetensors").exists()
    AutoModelForCausalLM.from_pretrained(final)


def test_sft_one_rank(sft_run):
    check_sft(sft_run)


def test_sft_logs_to_its_tracker_as_ppo_does(sft_run):
    """The stage's rows go to its tracker run (MLflow here, its local store in the run folder) at their steps, once."""
    from tracker_stores import mlflow_run, mlflow_steps

    client, run = mlflow_run(sft_run)
    assert mlflow_steps(client, run.info.run_id, "sft/loss") == list(range(1, 25))
    assert mlflow_steps(client, run.info.run_id, "sft/eval_loss") == [0, 12, 24]
    tags = run.data.tags
    assert tags["tether.stage"] == "sft" and tags["tether.group"] == "stages" and run.info.status == "FINISHED"
    assert tags["tether.checkpoint"] == str((sft_run / "checkpoints" / "final").resolve())
    assert run.data.params["train.epochs"] == "2"
    # cluster.train takes the checkpoint as model.policy as it is (everything short of starting actors)
    from cluster.config.ppo import DEFAULT_CONFIG, load_config
    from cluster.runtime.prepare import prepare
    policy, *_ = prepare(load_config(DEFAULT_CONFIG, [f"model.policy={sft_run}/checkpoints/final"]))
    assert policy == f"{sft_run}/checkpoints/final"


# The slow tier: the stage on a 2-rank group. The default tier: test_sft_one_rank (the stage) and
# tests/learner/test_rendezvous.py::test_two_rank_group_starts_and_stops_repeatedly (the 2-rank group).
@pytest.mark.slow
def test_sft_two_ranks(tmp_path):
    check_sft(run_sft(tmp_path, "sft-2", 2))


# The slow tier: a second stage start-up. The default tier: tests/learner/test_stage_steps.py::
# test_reward_step_scores_last_token_and_learns holds the pairwise loss and its step.
@pytest.mark.slow
@pytest.mark.parametrize("replicas", [1, 2])
def test_reward_model(sft_run, tmp_path, replicas):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from actors.reward import Reward

    data = write_jsonl(tmp_path / "pairs.jsonl", builtin_rows("rm", 112, seed=2))
    r = cli("cluster.reward_model", f"run.dir={tmp_path}", "run.name=rm", f"model.base={sft_run}",
            f"data.path={data}", "train.epochs=3", f"learner.replicas={replicas}", *COMMON)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "is not an SFT output" not in r.stderr
    rows = metrics(tmp_path / "rm")
    accuracy = [row["rm/eval_accuracy"] for row in rows if "rm/eval_accuracy" in row]
    print(f"rm {replicas} rank(s): held-out accuracy {accuracy} (chance {CHANCE})")
    assert accuracy[-1] >= MIN_ACCURACY
    final = tmp_path / "rm" / "checkpoints" / "final"
    assert AutoModelForSequenceClassification.from_pretrained(final).config.num_labels == 1
    stats = json.loads((final / "reward_stats.json").read_text())
    assert len(accuracy) == 4 and stats["count"] == 2 * 96 and stats["std"] > 0
    # PPO's Reward actor scores held-out pairs as the trained model ranked them, and
    # reward.normalize standardises with the saved statistics.
    tok = AutoTokenizer.from_pretrained(final)
    pairs = builtin_rows("rm", 16, seed=99)
    enc = lambda texts, eos: [np.array(tok(t, add_special_tokens=False)["input_ids"] + eos) for t in texts]  # noqa: E731
    prompts = enc([p["prompt"] for p in pairs], [])
    chosen = enc([p["chosen"] for p in pairs], [tok.eos_token_id])
    rejected = enc([p["rejected"] for p in pairs], [tok.eos_token_id])
    raw = Reward(config=reward_config(model=str(final)))
    c, rj = raw.score(prompts, chosen).scores, raw.score(prompts, rejected).scores
    assert (c > rj).mean() >= MIN_ACCURACY
    normed = Reward(config=reward_config(model=str(final), normalize=True)).score(prompts, chosen).scores
    assert normed == pytest.approx((c - stats["mean"]) / stats["std"], abs=1e-4)

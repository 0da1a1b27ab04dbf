"""PPO against a reward *model* (the RLHF case): a sequence classifier scores every rollout,
standardised with the reward_stats.json beside it (reward.normalize), and the run trains on
those scores.

The model is the tiny built one (cluster/demo/tiny_models.py build_reward_model), copied so that
its stats file is this test's: mean and std chosen far from its raw scores, so a run that
trained on raw scores, or standardised with other numbers, cannot pass.
"""
import json
import shutil

import numpy as np
import pytest
import yaml
from reward_configs import reward_config

from cluster import train

pytestmark = pytest.mark.e2e

STATS = {"mean": 2.0, "std": 0.25}  # the tiny untrained model's raw scores lie within about +-1


@pytest.fixture
def taken(monkeypatch):
    """The summary of every batch the learner trained on, as the driver took it from the buffer
    (its sample rows carry the token ids and the score the buffer stored)."""
    from cluster.runtime.loop.driver import Driver

    batches, take = [], Driver._take

    def take_and_keep(self):
        out = take(self)
        batches.append(out[1])
        return out

    monkeypatch.setattr(Driver, "_take", take_and_keep)
    return batches


def test_ppo_on_a_normalised_reward_model(cluster, tmp_path, reward_path, taken):
    rm = tmp_path / "rm"
    shutil.copytree(reward_path, rm)
    (rm / "reward_stats.json").write_text(json.dumps(STATS))
    argv = [f"run.dir={tmp_path}", "run.name=rm", "run.steps=2", "run.eval_every=0", "run.samples_every=0",
            "run.plot_every=0", "reward.function=null", f"reward.model={rm}", "reward.normalize=true",
            "model.dtype=float32"]  # the scores are checked against an fp32 re-score to 1e-3 below
    assert train.main(argv) == 0
    run_dir = tmp_path / "rm"
    assert json.loads((run_dir / "status.json").read_text())["state"] == "succeeded"
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["reward"]["model"] == str(rm) and config["reward"]["normalize"] is True
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["step"] for r in rows] == [1, 2] and len(taken) == 2
    # Each step's reward metrics are the scores of the batch it trained on, every one valid.
    for row, batch in zip(rows, taken):
        assert row["rollouts/invalid_scores"] == 0 and row["rollouts/used"] == batch.scores.size > 0
        assert row["reward/mean"] == pytest.approx(batch.scores.mean(), abs=1e-9)
        assert row["reward/std"] == pytest.approx(batch.scores.std(), abs=1e-9)
    # Those scores are the reward model's, standardised with the stats file: score the sampled
    # rollouts here with the same model, raw, and standardise by hand.
    from actors.reward import Reward

    samples = [s for batch in taken for s in batch.samples]
    assert len(samples) == 8
    raw = Reward(config=reward_config(model=str(rm)), device="cpu").score([np.array(s["prompt_ids"]) for s in samples],
                                                     [np.array(s["response_ids"]) for s in samples])
    assert raw.valid.all()
    expected = (raw.scores.astype(np.float64) - STATS["mean"]) / STATS["std"]
    got = np.array([s["score"] for s in samples])
    print(f"\nreward model: raw scores {np.round(raw.scores, 3)}, trained on {np.round(got, 3)}")
    np.testing.assert_allclose(got, expected, atol=1e-3)
    assert np.abs(raw.scores).max() < 1.5  # the premise: raw scores far from the stats' mean

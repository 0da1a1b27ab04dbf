"""A composed reward through the CLI (configs/arith-composed-tiny.yaml): the arithmetic task
scored by three sources at once, correct (weight 1), format (0.2) and length (0, a monitor).
Each source's mean is logged every step, and the score trained on is the weighted sum of the
trained sources alone: the monitor never enters it."""
import json

import pytest

from cluster import train
from cluster.config.ppo import CONFIGS

pytestmark = pytest.mark.e2e
WEIGHTS = {"correct": 1.0, "format": 0.2}


@pytest.mark.timeout(900)
def test_composed_reward_logs_each_source_and_trains_on_the_weighted_sum(cluster, tmp_path):
    argv = ["--config", str(CONFIGS / "arith-composed-tiny.yaml"), f"run.dir={tmp_path}", "run.name=composed",
            "run.steps=2", "run.samples_every=1", "run.eval_every=0", "data.eval_prompts=0",
            "run.plot_every=0", "run.checkpoint_every=0"]
    assert train.main(argv) == 0
    run = tmp_path / "composed"
    steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["step"] > 0]
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(steps) == 2 and samples
    for m in steps:
        assert m["rollouts/invalid_scores"] == 0
        trained = sum(w * m[f"reward/{name}/mean"] for name, w in WEIGHTS.items())
        assert m["reward/mean"] == pytest.approx(trained, abs=1e-6)
        # the monitor is logged, and far from nothing: had it entered the sum, reward/mean would show it
        assert m["reward/length/mean"] >= 1.0
        assert m["reward/mean"] != pytest.approx(trained + m["reward/length/mean"], abs=0.5)
    for s in samples:
        parts = s["components"]
        assert set(parts) == {"correct", "format", "length"}
        assert s["score"] == pytest.approx(sum(w * parts[name] for name, w in WEIGHTS.items()), abs=1e-6)
        assert parts["length"] == len(s["response"])

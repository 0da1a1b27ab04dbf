"""On-policy distillation through a real run (the command line, configs/distill-tiny.yaml): the
tiny policy learns from a teacher pre-trained on the corpus's positive sentences, with no reward
trained on. The sentiment reward is a weight-0 source, logged and never trained on: it rises
toward the teacher's own (about 2.4 on the held-out prompts) while the KL to the teacher falls.
Mid-run the reference replica, which hosts the teacher, is SIGKILLed (found by the pid it
reports through Ray): its chunk is scored again on the replacement and no step loses its
teacher."""
import json
import os
import signal
import threading

import pytest
import ray

from cluster import train
from cluster.config.ppo import CONFIGS

pytestmark = pytest.mark.e2e
STEPS = 16


class KillReference(threading.Thread):
    """SIGKILLs reference-0 once the run has logged step ``after``; records the pid it killed."""

    def __init__(self, metrics, after: int = 4):
        super().__init__(daemon=True)
        self.metrics, self.after, self.done, self.killed = metrics, after, threading.Event(), None

    def _logged(self) -> int:
        return len(self.metrics.read_text().splitlines()) - 1 if self.metrics.exists() else -1  # a row per step, 0 too

    def run(self):
        while not self.done.is_set() and self._logged() < self.after:
            self.done.wait(0.05)  # between looks; ends at once when the run does
        if not self.done.is_set():
            self.killed = ray.get(ray.get_actor("reference-0").health.remote())["pid"]
            os.kill(self.killed, signal.SIGKILL)


def test_the_tiny_policy_distils_a_positive_teacher_without_a_reward(cluster, tmp_path, caplog):
    argv = ["--config", str(CONFIGS / "distill-tiny.yaml"), f"run.dir={tmp_path}", "run.name=distill",
            f"run.steps={STEPS}", "run.eval_every=0", "run.plot_every=0", "run.checkpoint_every=0"]
    kill = KillReference(tmp_path / "distill" / "metrics.jsonl")
    kill.start()
    try:
        with caplog.at_level("INFO", logger="tether"):
            assert train.main(argv) == 0
    finally:
        kill.done.set()
        kill.join(60)
    assert kill.killed is not None
    assert any("reference-0 died" in r.getMessage() for r in caplog.records)
    steps = [m for m in map(json.loads, (tmp_path / "distill" / "metrics.jsonl").read_text().splitlines())
             if m["step"] > 0]
    assert len(steps) == STEPS
    for m in steps:  # every step trained on the teacher alone: no score entered the advantage
        assert m["reward/mean"] == 0 and m["rollouts/invalid_scores"] == 0
        assert "teacher/kl_mean" in m and "reward/sentiment/mean" in m
    mean = lambda key, part: sum(m[key] for m in part) / len(part)
    kl_first, kl_last = mean("teacher/kl_mean", steps[:3]), mean("teacher/kl_mean", steps[-3:])
    pos_first, pos_last = mean("reward/sentiment/mean", steps[:3]), mean("reward/sentiment/mean", steps[-3:])
    print(f"distillation: KL to the teacher {kl_first:.3f} -> {kl_last:.3f}; "
          f"sentiment (monitor) {pos_first:.3f} -> {pos_last:.3f}; killed reference-0 (pid {kill.killed})")
    assert kl_last < kl_first / 2
    assert pos_first < 1.0 and pos_last > pos_first + 1.0

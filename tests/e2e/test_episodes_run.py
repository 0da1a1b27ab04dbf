"""Multi-turn episodes through a real run (sync mode): the generators play each prompt's
episodes against the environment in worker processes, the environment's rewards are the
scores, and the learner trains on the policy's tokens of each transcript."""
import json
import os
from pathlib import Path

import pytest
import ray

from cluster import train

pytestmark = pytest.mark.e2e
HERE = Path(__file__).resolve().parent


@pytest.fixture
def env_cluster():
    """A local Ray whose workers (and their environment workers) import tests/e2e/episode_envs.py."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), saved) if p)
    ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()
    os.environ.pop("PYTHONPATH") if saved is None else os.environ.__setitem__("PYTHONPATH", saved)


def test_a_run_plays_episodes_and_trains_on_the_policys_tokens(env_cluster, tmp_path):
    assert train.main([f"run.dir={tmp_path}", "run.name=episodes", "env.environment=episode_envs:SayMore",
                       "env.max_turns=2", "env.max_tokens=40", "generator.sampling.max_new_tokens=12",
                       "data.prompts_per_step=4", "ppo.minibatch_size=16", "run.steps=2", "run.eval_every=0",
                       "run.samples_every=1", "run.plot_every=0", "model.dtype=float32"]) == 0
    run_dir = tmp_path / "episodes"
    assert json.loads((run_dir / "status.json").read_text())["state"] == "succeeded"
    steps = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        # two turns of at most 12 tokens: the environment's reward per turn is at most 1, so 2 per episode
        assert 0 < m["reward/mean"] <= 2.0 and m["learner/tokens"] <= 16 * 24
        # SayMore answers every turn and ends at the second: 2 turns unless a turn used up the budget
        assert 1 <= m["episode/turns_mean"] <= 2 and 0 < m["episode/env_tokens_frac"] < 1
        assert m["env/steps"] >= 16 and m["env/step_seconds"] > 0 and m["episode/invalid"] == m["env/errors"] == 0
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    turns = [[part["by"] for part in s["transcript"]] for s in samples]
    assert turns and all(t[0] == t[-1] == "policy" and set(t) <= {"policy", "environment"} for t in turns)
    assert any(t == ["policy", "environment", "policy"] for t in turns)
    assert all("Again." in p["text"] for s in samples for p in s["transcript"] if p["by"] == "environment")

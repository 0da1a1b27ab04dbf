"""Multi-turn episodes through a real run (sync mode, the command line): the generators play
each prompt's episodes of the two-turn arithmetic game (configs/arith-episodes-tiny.yaml)
against the environment in worker processes, the environment's rewards are the scores (no reward
pool starts), the learner trains on the policy's tokens of each transcript, and the tiny policy
learns; the episode metrics and the transcripts in samples.jsonl show it. The config names its
policy and prompts as builtin:arith, built on first use and cached."""
import json

import pytest

from cluster import train
from cluster.config.ppo import CONFIGS

pytestmark = pytest.mark.e2e


def test_the_tiny_policy_learns_the_two_turn_game(cluster_with_test_rewards, tmp_path):
    # builtin:arith: cached; the policy takes ~1-2 min on 2 cores the first time
    argv = ["--config", str(CONFIGS / "arith-episodes-tiny.yaml"), f"run.dir={tmp_path}", "run.name=game",
            "run.plot_every=0", "run.checkpoint_every=0"]
    assert train.main(argv) == 0
    actors = json.loads((tmp_path / "game" / "status.json").read_text())["actors"]
    assert actors and not [a for a in actors if a.startswith("reward")]  # the episodes carry their scores
    steps = [m for m in map(json.loads, (tmp_path / "game" / "metrics.jsonl").read_text().splitlines())
             if m["step"] > 0]
    assert len(steps) == 30 and all(m["episode/invalid"] == m["rollouts/invalid_scores"] == 0 for m in steps)
    for m in steps:  # two turns of at most 8 tokens each, the question between them as context
        assert 1 <= m["episode/turns_mean"] <= 2 and 0 <= m["episode/env_tokens_frac"] < 1
        assert m["env/steps"] >= 16 * 8 and m["env/step_seconds"] > 0 and m["env/errors"] == 0
        assert 0 <= m["reward/mean"] <= 1 and m["learner/tokens"] <= 128 * 16
    mean = lambda key, part: sum(m[key] for m in part) / len(part)
    first, last = mean("reward/mean", steps[:4]), mean("reward/mean", steps[-10:])
    turns_first, turns_last = mean("episode/turns_mean", steps[:4]), mean("episode/turns_mean", steps[-10:])
    print(f"two-turn game: reward first 4 steps {first:.3f} -> last 10 {last:.3f}; "
          f"turns {turns_first:.2f} -> {turns_last:.2f}")
    # The pre-trained policy answers right at the first try about a third of the time or less: most
    # episodes take the second turn. Learning to answer at once raises the score and cuts the turns.
    assert first < 0.4 and turns_first > 1.6
    assert last > first + 0.3 and turns_last < turns_first - 0.25
    samples = [json.loads(line) for line in (tmp_path / "game" / "samples.jsonl").read_text().splitlines()]
    parts = [[part["by"] for part in s["transcript"]] for s in samples]
    assert parts and all(p in (["policy"], ["policy", "environment", "policy"]) for p in parts)
    second_tries = [s for s in samples if len(s["transcript"]) == 3]
    assert all(s["transcript"][1]["text"] == s["prompt"] for s in second_tries)  # the question, asked again


def test_episodes_in_async_mode_span_weight_pushes(cluster_with_test_rewards, tmp_path):
    """Async mode with partial rollouts: generators play the next batches' episodes while the
    learner trains, and a push lands between two engine steps, so turns of one episode may
    come from two policy versions; the run trains on them within the staleness bound."""
    argv = ["--config", str(CONFIGS / "arith-episodes-tiny.yaml"), f"run.dir={tmp_path}", "run.name=async",
            "run.plot_every=0", "run.mode=async", "run.steps=6",
            "run.eval_every=0", "run.samples_every=1", "run.checkpoint_every=0"]
    assert train.main(argv) == 0
    steps = [m for m in map(json.loads, (tmp_path / "async" / "metrics.jsonl").read_text().splitlines())
             if m["step"] > 0]
    assert [m["step"] for m in steps] == list(range(1, 7))
    assert all(m["buffer/staleness_max"] <= 1 and m["episode/invalid"] == 0 and m["env/steps"] > 0 for m in steps)
    samples = [json.loads(line) for line in (tmp_path / "async" / "samples.jsonl").read_text().splitlines()]
    for s in samples:  # each part's version: never below the first, never decreasing
        versions = [p["version"] for p in s["transcript"]]
        assert versions == sorted(versions) and versions[0] == s["policy_version"]
    print("async episodes: partial_frac per step", [round(m["rollouts/partial_frac"], 3) for m in steps],
          "staleness", [m["buffer/staleness_max"] for m in steps])

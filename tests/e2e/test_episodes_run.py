"""Multi-turn episodes through a real run (sync mode): the generators play each prompt's
episodes against the environment in worker processes, the environment's rewards are the
scores, and the learner trains on the policy's tokens of each transcript; on the two-turn
arithmetic game (configs/arith-episodes-tiny.yaml) the tiny policy learns."""
import json

import pytest

from cluster import train
from cluster.config.ppo import CONFIGS
from cluster.demo import arithmetic

pytestmark = pytest.mark.e2e


def test_a_run_plays_episodes_and_trains_on_the_policys_tokens(cluster_with_test_rewards, tmp_path):
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


def test_the_tiny_policy_learns_the_two_turn_game(cluster_with_test_rewards, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    arithmetic.main(["--write", str(prompts)])
    policy = arithmetic.build_arithmetic_policy()  # cached; ~1-2 min on 2 cores the first time
    argv = ["--config", str(CONFIGS / "arith-episodes-tiny.yaml"), f"model.policy={policy}", f"data.path={prompts}",
            f"run.dir={tmp_path}", "run.name=game", "run.plot_every=0", "run.checkpoint_every=0"]
    assert train.main(argv) == 0
    steps = [m for m in map(json.loads, (tmp_path / "game" / "metrics.jsonl").read_text().splitlines())
             if m["step"] > 0]
    assert len(steps) == 30 and all(m["episode/invalid"] == m["rollouts/invalid_scores"] == 0 for m in steps)
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
    second_tries = [s for s in samples if len(s["transcript"]) == 3]
    assert all(s["transcript"][1]["text"] == s["prompt"] for s in second_tries)  # the question, asked again

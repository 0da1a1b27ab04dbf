"""kill -9 of the driver in a run of episodes, then run.resume: the resumed steps are the steps
of the run that was never interrupted (each turn is seeded by seed, version, prompt, sample and
turn, and rounds keep a batch's composition, so a replayed step plays the same episodes)."""
import os
import signal

import pytest
from jobs import finish, rows, start, status, wait_for_step

from cluster.config.ppo import CONFIGS
from cluster.demo import arithmetic

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # three whole runs


@pytest.fixture(scope="module")
def game(tmp_path_factory):
    prompts = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    arithmetic.main(["--write", str(prompts)])
    return [f"data.path={prompts}", f"model.policy={arithmetic.build_arithmetic_policy()}", "run.samples_every=0",
            "--config", str(CONFIGS / "arith-episodes-tiny.yaml")]  # last: the overrides go before it


def by_step(metric_rows, key):
    return [r.get(key) for r in metric_rows if r["step"] > 0]


def test_kill_9_then_resume_plays_the_same_episodes(game, tmp_path):
    baseline = tmp_path / "baseline"
    assert finish(start(baseline, *game)) == 0
    run_dir = tmp_path / "killed"
    proc = start(run_dir, *game)
    wait_for_step(run_dir, proc, 3)  # the checkpoint of step 2 is behind it
    os.kill(proc.pid, signal.SIGKILL)
    finish(proc)
    assert finish(start(run_dir, f"run.resume={run_dir}", *game)) == 0
    assert status(run_dir)["resumed_from_step"] == 2
    resumed, clean = rows(run_dir), rows(baseline)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4, 5]
    for key in ("reward/mean", "episode/turns_mean", "episode/env_tokens_frac", "learner/tokens"):
        assert by_step(resumed, key) == by_step(clean, key), key
    for key in ("kl/mean", "ppo/policy_loss", "ppo/grad_norm"):
        assert by_step(resumed, key) == pytest.approx(by_step(clean, key), rel=1e-5, abs=1e-8), key

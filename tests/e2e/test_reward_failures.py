"""A reward that turns non-finite, or stops returning, during a run ends it in one line naming the reward."""
import json
import re

import pytest

from cluster import train

pytestmark = pytest.mark.e2e


def test_mostly_non_finite_scores_fail_the_run_naming_the_reward(cluster_with_test_rewards, tmp_path, capsys):
    """7 of 8 scores NaN at step 1 is above reward.max_invalid_fraction (0.5 by default)."""
    rc = train.main([f"run.dir={tmp_path}", "run.name=nan", "reward.function=nan_reward:nan_after_probe",
                     "run.steps=2", "run.eval_every=0", "run.plot_every=0", "run.samples_every=0"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2, last
    assert last.startswith("tether: error: reward function nan_reward:nan_after_probe: 56 of 64 scores at step 1 "
                           "were invalid"), last
    assert "reward.max_invalid_fraction=0.5" in last
    status = json.loads((tmp_path / "nan" / "status.json").read_text())
    assert status["state"] == "failed" and status["reason"] in last


@pytest.mark.timeout(400)  # below buffer.timeout_s (600 s): a step left waiting for the scores fails the test
def test_a_reward_that_stops_returning_invalidates_its_pairs_and_the_rule_stops_the_run(cluster_with_test_rewards,
                                                                                       tmp_path, capsys, caplog):
    """Every call after the probe hangs: each is abandoned after reward.timeout_s, its pairs invalid."""
    rc = train.main([f"run.dir={tmp_path}", "run.name=hang", "reward.function=slow_reward:hangs_after_probe",
                     "reward.timeout_s=1", "run.steps=2", "run.eval_every=0", "run.plot_every=0",
                     "run.samples_every=0"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2, last
    assert last.startswith("tether: error: reward function slow_reward:hangs_after_probe: 64 of 64 scores at step 1 "
                           "were invalid"), last
    assert "reward: reward function slow_reward:hangs_after_probe did not return within reward.timeout_s=1 s" \
        in caplog.text


@pytest.mark.slow
def test_a_replica_that_dies_leaves_rays_banner_in_library_log_not_on_the_console(cluster_with_test_rewards,
                                                                                 tmp_path, capfd, caplog):
    """tether's one line says a replica died; Ray's many-line banner about it is kept in library.log."""
    rc = train.main([f"run.dir={tmp_path}", "run.name=dies", "reward.function=slow_reward:dies_once",
                     "run.steps=2", "run.eval_every=0", "run.plot_every=0", "run.samples_every=0"])
    console = capfd.readouterr()
    assert rc == 0, console.err[-2000:]
    assert re.search(r"reward-\d died \(", caplog.text)  # tether's line, on the console in a real run
    assert "A worker died or was killed" not in console.out + console.err
    assert "A worker died or was killed" in (tmp_path / "dies" / "library.log").read_text()

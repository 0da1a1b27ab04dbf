"""reward.url end to end: the tiny default job scored by a reward server on loopback (a thread of
this process, tests/reward_server.py), healthy and going down mid-run."""
import json
import threading

import pytest
from reward_server import RewardServer, rewards_by_length

from cluster import train

pytestmark = pytest.mark.e2e
ARGS = ["run.steps=2", "run.eval_every=0", "run.plot_every=0", "run.samples_every=0", "reward.function=null"]
PROBE_PAIRS = 2           # the start-up probe's example pairs (cluster/runtime/prepare.py)
STEP_PAIRS = 16 * 4       # data.prompts_per_step x generator.sampling.n of the tiny default


def _steps(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # the default suite's run below is scored by the server for a step before it goes down
def test_a_run_scored_by_a_reward_server_trains_and_reports_its_calls(cluster, tmp_path):
    with RewardServer() as server:
        rc = train.main([f"run.dir={tmp_path}", "run.name=ok", f"reward.url={server.url}", *ARGS])
    assert rc == 0
    steps = [m for m in _steps(tmp_path / "ok") if "reward/http_requests" in m]
    assert len(steps) == 2
    for m in steps:
        assert m["rollouts/invalid_scores"] == 0 and m["reward/http_retries"] == 0
        assert m["reward/http_requests"] >= 1 and m["reward/http_seconds"] > 0
    pairs = sum(len(b["query"]) for b in server.bodies)
    assert pairs == PROBE_PAIRS + 2 * STEP_PAIRS  # every rollout scored once, by the server
    assert set(server.bodies[-1]) == {"query", "prompts", "labels", "responses", "columns"}


@pytest.mark.timeout(600)
def test_a_server_that_goes_down_mid_run_invalidates_its_pairs_and_the_rule_stops_the_run(cluster, tmp_path,
                                                                                        capsys, caplog):
    """The server scores the probe and step 1, then shuts down (its port refuses connections):
    step 2's pairs are invalid after the retries, and reward.max_invalid_fraction ends the run
    with one line naming the URL."""
    scored, lock = [0], threading.Lock()

    def reply(i, body):
        with lock:
            if scored[0] >= PROBE_PAIRS + STEP_PAIRS:
                threading.Thread(target=server.close, daemon=True).start()  # down: no more connections
                return 503, "shutting down"
            scored[0] += len(body["query"])
        return rewards_by_length(body)

    server = RewardServer(reply)
    with server:
        rc = train.main([f"run.dir={tmp_path}", "run.name=down", f"reward.url={server.url}", "reward.http.retries=2",
                         "reward.http.backoff_s=0.1", *ARGS])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2, last
    assert last.startswith(f"tether: error: reward server {server.url}: 64 of 64 scores at step 2 were invalid"), last
    assert f"reward: reward server {server.url} " in caplog.text  # each failed batch's line, in the log
    (step1,) = [m for m in _steps(tmp_path / "down") if "reward/http_requests" in m]
    assert step1["rollouts/invalid_scores"] == 0
    status = json.loads((tmp_path / "down" / "status.json").read_text())
    assert status["state"] == "failed" and status["reason"] in last

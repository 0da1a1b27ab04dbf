"""An agent program's episodes through a real run (sync mode, the command line): the generator
plays each prompt's episodes of the two-turn arithmetic game with an agent written against the
OpenAI client (configs/arith-agent-tiny.yaml), its calls going through the run's gateway to the
generator that plays them; the agent's returns are the scores (no reward pool starts), the
learner trains on the policy's answers as vLLM sampled them, and the tiny policy learns.
Mid-run, the gateway's process and then the generator's are SIGKILLed (found by the pids they
report through Ray) while episodes are in flight: the gateway's sessions are played again from
the start, the generator's chunk on its replacement, and no episode is lost or invalid."""
import json
import os
import signal
import threading
import time

import pytest
import ray

from cluster import train
from cluster.config.ppo import CONFIGS

pytestmark = pytest.mark.e2e
SESSIONS = 16 * 8  # prompts_per_step x generator.sampling.n


class Kills(threading.Thread):
    """SIGKILLs the gateway once it has served ``after`` calls, then generator-0 once the
    restarted gateway has served ``after`` more; records what it killed."""

    def __init__(self, after: int = 300):
        super().__init__(daemon=True)
        self.after, self.done, self.killed = after, threading.Event(), []

    def _served(self, at_least: int) -> bool:
        """Waits until the gateway has served ``at_least`` calls (False: the run ended first)."""
        deadline = time.monotonic() + 600
        while not self.done.is_set() and time.monotonic() < deadline:
            try:
                if ray.get(ray.get_actor("gateway").health.remote(), timeout=30)["requests"] >= at_least:
                    return True
            except (ValueError, ray.exceptions.RayError):  # not started yet, or restarting
                pass
            self.done.wait(0.05)  # between looks; ends at once when the run does
        return False

    def run(self):
        for victim in ("gateway", "generator-0"):
            if not self._served(self.after):
                return
            os.kill(ray.get(ray.get_actor(victim).health.remote())["pid"], signal.SIGKILL)
            self.killed.append(victim)


def test_the_tiny_policy_learns_the_game_an_agent_plays_through_the_gateway(cluster_with_test_rewards, tmp_path,
                                                                            caplog):
    argv = ["--config", str(CONFIGS / "arith-agent-tiny.yaml"), f"run.dir={tmp_path}", "run.name=agent",
            "run.steps=16", "run.eval_every=0", "run.samples_every=16", "run.plot_every=0",
            "run.checkpoint_every=0"]
    kills = Kills()
    kills.start()
    try:
        with caplog.at_level("INFO", logger="tether"):
            assert train.main(argv) == 0
    finally:
        kills.done.set()
        kills.join(60)
    assert kills.killed == ["gateway", "generator-0"]
    assert any("/sessions/<id>/v1 serves model 'policy'" in r.getMessage() for r in caplog.records)
    actors = json.loads((tmp_path / "agent" / "status.json").read_text())["actors"]
    assert actors and not [a for a in actors if a.startswith("reward")]  # the agent's returns are the scores
    steps = [m for m in map(json.loads, (tmp_path / "agent" / "metrics.jsonl").read_text().splitlines())
             if m["step"] > 0]
    assert len(steps) == 16
    for m in steps:  # every episode of every step played to its end, once or again after a kill
        assert m["agent/sessions"] == SESSIONS and m["agent/invalid"] == m["rollouts/invalid_scores"] == 0
        assert 1 <= m["agent/calls_per_session"] <= 2 and m["agent/without_calls"] == 0
    assert sum(m["agent/replayed"] for m in steps) > 0  # the gateway's sessions, played again
    assert sum(m["rollouts/redispatched_chunks"] for m in steps) > 0  # the generator's chunk, on its replacement
    mean = lambda key, part: sum(m[key] for m in part) / len(part)
    first, last = mean("reward/mean", steps[:4]), mean("reward/mean", steps[-4:])
    calls_first, calls_last = mean("agent/calls_per_session", steps[:4]), mean("agent/calls_per_session", steps[-4:])
    print(f"agent game: reward first 4 steps {first:.3f} -> last 4 {last:.3f}; "
          f"calls per episode {calls_first:.2f} -> {calls_last:.2f}; killed {kills.killed}")
    # As the environment's game (tests/e2e/test_episodes_run.py): most episodes take the second call
    # at first; answering right at once raises the score and cuts the calls.
    assert first < 0.4 and calls_first > 1.6
    assert last > first + 0.2 and calls_last < calls_first - 0.15
    samples = [json.loads(line) for line in (tmp_path / "agent" / "samples.jsonl").read_text().splitlines()]
    parts = [[part["by"] for part in s["transcript"]] for s in samples]
    assert parts and all(p in (["policy"], ["policy", "environment", "policy"]) for p in parts)
    second_tries = [s for s in samples if len(s["transcript"]) == 3]
    assert all(s["transcript"][1]["text"] == s["prompt"] for s in second_tries)  # the question, asked again


def test_an_agent_that_does_not_import_is_refused_before_anything_starts(tmp_path, capsys):
    argv = ["--config", str(CONFIGS / "arith-agent-tiny.yaml"), f"run.dir={tmp_path}", "run.name=missing",
            "env.agent=agents_nowhere:agent"]
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "env.agent 'agents_nowhere:agent': cannot import module 'agents_nowhere'" in err[-1], err
    assert not (tmp_path / "missing").exists()

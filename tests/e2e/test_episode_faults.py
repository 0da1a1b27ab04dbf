"""A generator SIGKILLed mid-episode, while its episodes wait on their environments: its
environment workers die with it, its chunk is played again on a replacement, no prompt is lost
or trained twice, and the run's trajectory is the one a run without the kill takes."""
import os
import shutil
import signal
import threading
import time

import pytest
import ray
from accounting import Accounting
from episode_envs import episode_marks

from cluster.config.ppo import DEFAULT_CONFIG, load_config
from cluster.runtime.prepare import prepare

pytestmark = pytest.mark.e2e
OVERRIDES = ["model.dtype=float32", "run.eval_every=0", "run.samples_every=0", "run.plot_every=0", "run.steps=2",
             "generator.replicas=2", "data.prompts_per_step=4", "generator.sampling.max_new_tokens=12",
             "ppo.minibatch_size=16", "env.environment=episode_envs:MarkedSayMore", "env.max_turns=2",
             "env.max_tokens=40", "env.workers=1"]
# What the sampled tokens decide (equal), and what log-probs computed by a fresh engine give (to float noise).
SAMPLED = ("reward/mean", "reward/std", "episode/turns_mean", "episode/env_tokens_frac", "learner/tokens")
COMPUTED = ("kl/mean", "ppo/policy_loss", "ppo/value_loss")


def run(tmp_path, kill: bool, schedule: str = "rounds"):
    """Two steps; with ``kill``, generator-0 is SIGKILLed by its pid at its first environment step."""
    from cluster.runtime.loop.driver import Driver
    from cluster.runtime.observe.metrics import RunMetrics
    from cluster.runtime.pools.launch import create_pools

    marks = episode_marks()  # this module's, from cluster_with_test_rewards; empty for each run
    shutil.rmtree(marks, ignore_errors=True)
    marks.mkdir()
    if not kill:
        (marks / "release").touch()
    cfg = load_config(DEFAULT_CONFIG, OVERRIDES + [f"env.schedule={schedule}"])
    policy, tokenizer_path, tokenizer, train_set, _ = prepare(cfg)
    pools = create_pools(cfg, policy_path=policy, tokenizer_path=tokenizer_path)
    victim = ray.get(pools.generators.handles()["generator-0"].health.remote())["pid"]
    killed = {}

    def killer():  # the environment marks the generator it runs under, then waits: kill it there
        deadline = time.monotonic() + 300
        while not (marks / str(victim)).exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        killed["env_worker"] = int((marks / str(victim)).read_text())
        os.kill(victim, signal.SIGKILL)
        (marks / "release").touch()

    thread = threading.Thread(target=killer, daemon=True)
    try:
        with RunMetrics(run_dir=tmp_path, plot_every=0) as metrics:
            driver = Driver(cfg, pools=pools, dataset=train_set, eval_dataset=None, tokenizer=tokenizer,
                            metrics=metrics)
            accounting = Accounting(driver)
            thread.start() if kill else None
            rows = [driver.step() for _ in range(2)]
            envs = [ray.get(h.health.remote())["env"] for h in pools.generators.handles().values()]
    finally:
        pools.shutdown()
        (marks / "release").touch()
    assert all(e["env_workers"] == 1 and e["episodes_running"] == 0 for e in envs)  # every generator's, closed
    return rows, accounting, killed


@pytest.mark.parametrize("schedule", ["rounds", "continuous"])
def test_a_generator_killed_mid_episode_loses_nothing_and_changes_nothing(cluster_with_test_rewards, tmp_path,
                                                                          schedule):
    """Both schedules lose nothing; rounds also sample again exactly what the first play did (a
    continuous play's batches depend on timing, so its tokens may differ)."""
    rows, accounting, killed = run(tmp_path / "killed", kill=True, schedule=schedule)
    assert killed, "generator-0 never ran an environment step"
    deadline = time.monotonic() + 60  # the environment worker notices its parent is gone and exits
    while _alive(killed["env_worker"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(killed["env_worker"]), "an environment worker outlived its generator"
    assert sum(m["rollouts/redispatched_chunks"] for m in rows) >= 1
    assert accounting.lost_and_twice() == (0, 0)
    assert all(m["rollouts/used"] == 16 and m["episode/invalid"] == 0 for m in rows)
    if schedule == "continuous":
        return
    clean, _, _ = run(tmp_path / "clean", kill=False)
    # The chunk played again on the replacement sampled what it would have: same seeds per turn.
    for key in SAMPLED:
        assert [m[key] for m in rows] == [m[key] for m in clean], key
    for key in COMPUTED:
        assert [m[key] for m in rows] == pytest.approx([m[key] for m in clean], rel=1e-4), key


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split()[2] == "Z"

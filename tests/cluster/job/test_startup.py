"""A job's start before its pools: the start-up clock, and whether a local Ray fits the machine."""
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.config.ppo import load_config

REPO = Path(__file__).resolve().parents[3]
GIB = 1 << 30
# PPO configs meant for a CPU machine like this one (the GPU ones are for GPU nodes).
CPU_CONFIGS = ("tiny-cpu.yaml", "bench-30m.yaml", "arith-tiny.yaml", "arith-episodes-tiny.yaml")


@pytest.mark.integration
def test_start_up_is_timed_from_the_python_entrypoint_not_the_shell_before_it():
    """scripts/run.sh runs the set-up and then execs Python in the same process: the time
    spent before the exec (here a sleep several times the clock's own reading on this machine,
    measured first without one) is not the job's start-up."""
    own = imports_seconds(after_sleeping=0)
    pause = 3 + 4 * own
    assert imports_seconds(after_sleeping=pause) < pause, (own, pause)


def imports_seconds(after_sleeping: float) -> float:
    """The start-up clock's first phase in a process the shell execs into after a sleep."""
    code = "from cluster.job.startup import StartupClock; print(StartupClock().seconds['imports'])"
    result = subprocess.run(["sh", "-c", f'sleep {after_sleeping:.2f}; exec "{sys.executable}" -c "{code}"'],
                            cwd=REPO, capture_output=True, text=True, timeout=120 + after_sleeping)
    assert result.returncode == 0, result.stderr[-2000:]
    return float(result.stdout.strip().splitlines()[-1])


@pytest.mark.integration
def test_only_the_first_job_of_a_process_counts_the_imports():
    """A sweep's trials and the pipeline's stages run in one process: a later job's start-up
    counts no imports (it did none), however long the jobs before it ran."""
    code = ("from cluster.job.startup import StartupClock; "
            "first = StartupClock().seconds['imports']; print(first, StartupClock().seconds['imports'])")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    first, later = map(float, result.stdout.split())
    assert first > 0 and later == 0.0
    # The pipeline's first stage (SFT) claims them: its PPO stage, later, counts none.
    code = ("import time; from cluster.job.startup import StartupClock, claim_imports; "
            "claim_imports(time.time()); print(StartupClock().seconds['imports'])")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and float(result.stdout) == 0.0, result.stderr[-2000:]


def this_machine():
    from cluster.job.startup import Machine
    return Machine(ram_bytes=24 * GIB, cores=2)  # the machine tether is developed on


def problem(*overrides, machine=None):
    from cluster.job.startup import fit_problem
    return fit_problem(load_config(None, list(overrides)), machine or this_machine())


@pytest.mark.unit
@pytest.mark.parametrize("name", CPU_CONFIGS)
def test_shipped_cpu_configs_fit_the_development_machine(name):
    from cluster.job.startup import Machine, fit_problem
    cfg = load_config(REPO / "configs" / name)
    assert fit_problem(cfg, Machine(ram_bytes=24 * GIB, cores=2)) is None


@pytest.mark.unit
@pytest.mark.parametrize("overrides", [
    [],
    ["generator.replicas=3", "reference.replicas=2", "reward.replicas=2", "learner.replicas=2"],
    ["generator.replicas=2", "reward.replicas=2", "learner.replicas=2", "run.mode=async"],
])
def test_the_default_job_and_multi_replica_pools_fit(overrides):
    assert problem(*overrides) is None


@pytest.mark.unit
def test_forty_generators_need_more_memory_than_the_machine_has():
    message = problem("generator.replicas=40")
    assert message.startswith("pool generator: 40 replicas x ~0.8")
    assert "more than this machine's 24.0 GiB of RAM" in message
    assert "lower generator.replicas (at most 24 fit here)" in message and "resources.address" in message


@pytest.mark.unit
def test_cpus_far_beyond_the_cores_are_refused_even_with_memory_to_spare():
    from cluster.job.startup import Machine
    roomy = Machine(ram_bytes=1024 * GIB, cores=2)
    assert problem("generator.replicas=13", machine=roomy) is None  # 16 CPUs: 8 per core
    message = problem("generator.replicas=14", machine=roomy)
    assert message.startswith("pool generator: 14 replicas x 1 CPU bring the run to 17 CPUs, more than "
                              "8x this machine's 2 cores"), message
    assert "(at most 13 fit here)" in message


@pytest.mark.unit
def test_an_explicit_local_cluster_size_bounds_the_pools():
    message = problem("learner.replicas=2", "resources.num_cpus=4")
    assert message.startswith("pool learner: 2 replicas x 1 CPU bring the run to 5 CPUs, more than "
                              "resources.num_cpus=4"), message


def sparse_model(folder):
    """A model folder whose one weight file is a sparse 1 GiB file (its size, no disk)."""
    folder.mkdir()
    with open(folder / "model.safetensors", "wb") as f:
        f.truncate(GIB)
    return folder


@pytest.mark.unit
def test_the_estimate_grows_with_the_model_and_shrinks_with_zero_sharding(tmp_path):
    from cluster.job.startup import BASE_BYTES, replica_bytes
    model = sparse_model(tmp_path / "policy")
    cfg = load_config(None, ["learner.replicas=2", "learner.zero_stage=0"])
    per = replica_bytes(cfg, str(model))
    assert per["generator"] == BASE_BYTES["generator"] + GIB + cfg.generator.engine.kv_cache_bytes
    assert per["reference"] == BASE_BYTES["reference"] + GIB
    assert per["reward"] == BASE_BYTES["reward"]  # a reward function holds no model
    assert per["learner"] == BASE_BYTES["learner"] + 4 * GIB  # weights, gradients, two Adam moments
    sharded = replica_bytes(load_config(None, ["learner.replicas=2", "learner.zero_stage=3"]), str(model))
    assert sharded["learner"] == BASE_BYTES["learner"] + 2 * GIB
    on_gpu = replica_bytes(load_config(None, ["generator.num_gpus=1"]), str(model))
    assert on_gpu["generator"] == BASE_BYTES["generator"]  # the weights and KV cache live on the device


@pytest.mark.unit
def test_a_judge_on_cpu_counts_its_weights_and_kv_cache(tmp_path):
    from cluster.job.startup import BASE_BYTES, replica_bytes
    judge = sparse_model(tmp_path / "judge")
    cfg = load_config(None, ["reward.function=null", f"reward.judge.model={judge}"])
    kv = cfg.reward.judge.engine.kv_cache_bytes
    assert replica_bytes(cfg)["reward"] == BASE_BYTES["reward"] + GIB + kv
    on_gpu = load_config(None, ["reward.function=null", f"reward.judge.model={judge}", "reward.num_gpus=1"])
    assert replica_bytes(on_gpu)["reward"] == BASE_BYTES["reward"]


@pytest.mark.unit
def test_an_environment_that_scores_its_episodes_needs_no_reward_pool():
    from cluster.job.startup import replica_bytes
    env = ["env.environment=cluster.demo.arithmetic:SecondChance"]
    assert "reward" not in replica_bytes(load_config(None, env))
    assert problem(*env, "reward.replicas=20") is None  # 20 replicas of 1 CPU would be over 16: none start
    assert problem(*env, "env.reward=pool", "reward.replicas=20").startswith("pool reward: 20 replicas x 1 CPU")


@pytest.mark.unit
def test_only_a_ray_of_our_own_is_checked(monkeypatch):
    from cluster.job.startup import starts_local_ray
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr("ray.is_initialized", lambda: False)  # as in a driver before it connects
    assert starts_local_ray(load_config(None, []))
    assert not starts_local_ray(load_config(None, ["resources.address=10.0.0.1:6379"]))
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert not starts_local_ray(load_config(None, []))

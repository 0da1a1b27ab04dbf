"""The thread plan: in sync mode the phase that runs gets the node's cores (cluster/runtime/pools/threads.py)."""
import pytest

from cluster.config.ppo import ConfigError, load_config
from cluster.runtime.pools.threads import chunks_per_generator, plan_threads, thread_env


def plan(cores, *overrides):
    return plan_threads(load_config(None, list(overrides)), cores)


@pytest.mark.unit
def test_sync_phases_share_the_node_cores():
    # default: one replica per pool, a reward function (no model): generator, reference and
    # learner each run alone in their phase, so each gets every core
    assert plan(2) == {"generator": 2, "reference": 2, "reward": 1, "learner": 2}
    assert plan(16, "generator.replicas=4", "learner.replicas=2") == \
        {"generator": 4, "reference": 16, "reward": 1, "learner": 8}


@pytest.mark.unit
def test_reference_and_reward_model_score_together(tmp_path):
    cfg = plan(8, "reward.function=null", f"reward.model={tmp_path}", "reference.replicas=3")
    assert cfg["reference"] == cfg["reward"] == 2  # 8 cores over 3 + 1 scorers


@pytest.mark.unit
def test_the_learner_scoring_the_reference_is_one_of_the_scorers(tmp_path):
    """reference.on_learner: learner rank 0 scores beside the reward model, so each takes half the
    cores for that phase (both at full width oversubscribe the node); the learner trains on all."""
    from cluster.runtime.pools.launch import learner_rank_config

    overrides = ["reward.function=null", f"reward.model={tmp_path}", "learner.lora.rank=8",
                 "reference.on_learner=true", "reference.model=null"]
    threads = plan(2, *overrides)
    assert threads["reference"] == threads["reward"] == 1 and threads["learner"] == 2
    assert learner_rank_config(load_config(None, overrides), threads).reference_threads == 1
    assert learner_rank_config(load_config(None, []), plan(2)).reference_threads == 0  # a pool scores it


@pytest.mark.unit
def test_a_judge_replica_hosts_an_engine_like_a_generator():
    """reward.judge: the reward replica scores with the reference (it computes), its vLLM engine
    runs in the actor's process on CPU with unbound threads, and on GPU keeps vLLM's layout."""
    from cluster.runtime.pools.pool import pool_env

    judge = ["reward.function=null", "reward.judge.model=builtin:judge"]
    assert plan(8, *judge, "reference.replicas=3")["reward"] == 2  # 8 cores over 3 + 1 scorers
    env = pool_env(load_config(None, judge), "reward", 2)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    on_gpu = pool_env(load_config(None, [*judge, "reward.num_gpus=1"]), "reward", 2)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in on_gpu
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in pool_env(load_config(None, []), "reward", 1)  # a function
    # a judge among reward.sources is hosted as reward.judge is; an engine that compiles keeps torch.compile
    parts = ["reward.function=null", "reward.sources=[{name: fmt, function: 'cluster.demo.arithmetic:well_formed'}, "
             "{name: judge, judge: {model: 'builtin:judge', engine: {enforce_eager: false}}}]"]
    env = pool_env(load_config(None, parts), "reward", 2)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and "TORCHDYNAMO_DISABLE" not in env
    assert pool_env(load_config(None, judge), "reward", 2)["TORCHDYNAMO_DISABLE"] == "1"


@pytest.mark.unit
def test_async_and_reserved_keep_rays_rule():
    want = {"generator": 1, "reference": 1, "reward": 1, "learner": 3}
    assert plan(16, "run.mode=async", "learner.num_cpus=3") == want
    assert plan(16, "resources.cpu_threads=reserved", "learner.num_cpus=3") == want


@pytest.mark.unit
def test_never_below_the_reserved_cpus_nor_on_gpu_pools():
    assert plan(2, "learner.num_cpus=4")["learner"] == 4
    assert plan(64, "learner.num_gpus=1", "learner.num_cpus=2")["learner"] == 2


@pytest.mark.unit
def test_scoring_overlaps_generation_only_where_pools_run_at_once():
    one = lambda *o: chunks_per_generator(load_config(None, list(o)))  # noqa: E731
    assert one() == 1  # sync CPU pools take turns: one whole chunk per generator
    assert one("run.mode=async") == one("resources.cpu_threads=reserved") == one("generator.num_gpus=1") == 2


@pytest.mark.unit
def test_vllm_worker_threads_are_unbound():
    assert thread_env(3) == {"OMP_NUM_THREADS": "3"}
    assert thread_env(2, vllm=True) == {"OMP_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


@pytest.mark.unit
def test_bad_setting_is_one_line():
    with pytest.raises(ConfigError, match="resources.cpu_threads='all' is unknown; use one of phase, reserved"):
        load_config(None, ["resources.cpu_threads=all"])


@pytest.mark.integration
def test_ray_actor_runs_the_planned_threads():
    """Ray sets OMP_NUM_THREADS = num_cpus only where it is unset: the plan's value must win,
    above and below the actor's num_cpus. (What a worker gets without a plan depends on the
    environment the Ray cluster was started from, so it is not asserted here.)"""
    import ray

    def threads():
        import torch
        return torch.get_num_threads()

    import rays
    rays.shared()
    probe = ray.remote(num_cpus=1)(threads)
    assert ray.get(probe.options(runtime_env={"env_vars": thread_env(2)}).remote()) == 2
    assert ray.get(probe.options(num_cpus=2, runtime_env={"env_vars": thread_env(1)}).remote()) == 1

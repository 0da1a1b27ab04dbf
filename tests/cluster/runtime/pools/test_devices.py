"""Each pool keeps to the devices it reserved: an actor that asked for no GPU sees none."""
import pytest


@pytest.mark.integration
def test_an_actor_without_gpus_sees_no_gpu():
    import os

    import ray

    from cluster.config.ppo import TetherConfig
    from cluster.runtime.pools.pool import actor_env

    @ray.remote(num_cpus=0, num_gpus=0)
    def visible_gpus():
        import os
        return os.environ.get("CUDA_VISIBLE_DEVICES")

    import rays
    rays.shared()
    env = actor_env(TetherConfig())
    # Ray's own default leaves the variable as inherited: on a GPU node, every GPU.
    assert ray.get(visible_gpus.remote()) == os.environ.get("CUDA_VISIBLE_DEVICES")
    assert ray.get(visible_gpus.options(runtime_env={"env_vars": env}).remote()) == ""

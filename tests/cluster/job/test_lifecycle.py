"""A resumed run starts its pools at the sizes cluster.scale left them (the checkpoint's)."""
import json

import pytest

from cluster.config.ppo import load_config
from cluster.runtime.state import checkpoint
from cluster.runtime.state.checkpoint import RunState

pytestmark = pytest.mark.unit


def state(**pool_sizes) -> RunState:
    return RunState(step=4, version=4, batches_issued=4, unfinished=(), kl_beta=0.05, pinned={},
                    pool_sizes=pool_sizes)


def test_the_checkpoint_keeps_the_pool_sizes_and_reads_older_ones_without():
    saved = state(generator=3, reference=1, reward=2)
    assert RunState.from_json(saved.to_json()) == saved
    older = json.loads(saved.to_json())
    del older["pool_sizes"]  # a checkpoint written before the sizes were recorded
    assert RunState.from_json(json.dumps(older)).pool_sizes == {}


def test_a_resume_starts_the_pools_at_the_scaled_sizes():
    from cluster.runtime.state.resume import resume_pool_sizes
    cfg, line = resume_pool_sizes(load_config(None, []), state(generator=3, reference=1, reward=2), [])
    assert (cfg.generator.replicas, cfg.reference.replicas, cfg.reward.replicas) == (3, 1, 2)
    assert line == ("resume: pools at the sizes they were scaled to: generator=3 reward=2 (the config says "
                    "generator=1 reward=1; set <pool>.replicas on the resume command line to choose)")


def test_the_resume_command_line_wins_over_the_scaled_sizes():
    from cluster.runtime.state.resume import resume_pool_sizes
    overrides = ["run.resume=runs/x", "generator.replicas=1"]
    cfg, line = resume_pool_sizes(load_config(None, overrides), state(generator=3, reference=1, reward=2), overrides)
    assert (cfg.generator.replicas, cfg.reward.replicas) == (1, 2)
    assert line == ("resume: pools at the sizes they were scaled to: reward=2 (the config says reward=1; set "
                    "<pool>.replicas on the resume command line to choose); generator=1 from the command line "
                    "(it was scaled to 3)")


def test_nothing_to_say_when_the_sizes_were_never_changed():
    from cluster.runtime.state.resume import resume_pool_sizes
    cfg = load_config(None, [])
    assert resume_pool_sizes(cfg, state(generator=1, reference=1, reward=1), []) == (cfg, None)
    assert resume_pool_sizes(cfg, state(), []) == (cfg, None)  # an older checkpoint: the config's sizes


def test_checkpoints_on_disk_carry_the_sizes(tmp_path):
    class Learner:
        def save(self, path):
            path.mkdir(parents=True)

    checkpoint.save(tmp_path, state(generator=2, reference=1, reward=1), Learner(), keep=1)
    assert checkpoint.load_state(checkpoint.latest(tmp_path)).pool_sizes == {"generator": 2, "reference": 1,
                                                                              "reward": 1}

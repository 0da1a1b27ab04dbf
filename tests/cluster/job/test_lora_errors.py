"""learner.lora mistakes through the real entrypoint: one line naming the key and the fix, exit 2,
before any actor starts (the run is `python -m cluster.train` in a child process, tests/entrypoints.py)."""
import pytest
from entrypoints import assert_one_line_error

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("args, message", [
    (["learner.lora.rank=8", "learner.lora.target_modules=[qkv]"],
     "learner.lora.target_modules=['qkv'] matches no module of Qwen2ForCausalLM"),
    (["learner.lora.rank=16", "generator.engine.max_lora_rank=8"],
     "learner.lora.rank=16 is above generator.engine.max_lora_rank=8"),
])
def test_the_job_ends_in_one_line_with_exit_2(tmp_path, entrypoints, args, message):
    result = entrypoints.run("cluster.train", [f"run.dir={tmp_path / 'runs'}", *args], env={"RAY_ADDRESS": ""})
    assert_one_line_error(result, tmp_path / "runs", message)

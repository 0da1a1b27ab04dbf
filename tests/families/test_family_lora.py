"""LoRA on each family the adapters are checked with: three PPO steps of the whole service with a
rank-8 adapter on every linear layer. The learner pushes the adapter alone, every generator proves
it bound all of the adapter's modules with the tensors sent (a push that binds nothing or serves a
stale adapter ends the run), vLLM's log-probs of base + adapter meet the learner's to 1e-3 (fp32),
and the reference pool serves the base. Phi-3 has fused projections (qkv_proj, gate_up_proj: one
adapter each in the learner and in vLLM); Gemma-2 soft-caps its logits and attention; Qwen2 ties
its head; Llama is the plain case."""
import json

import numpy as np
import pytest

from cluster import train
from cluster.demo.families import build_family_policy

# Phi-3's fused projections are the case with the most of its own (two engines' packings must agree);
# Qwen2 is the default job's model (tests/e2e/test_lora_run.py::test_pushes_only_the_adapter_and_the_sampler_agrees);
# the others are in the slow tier.
DEFAULT_TIER = ("phi3",)
FAMILIES = ("phi3", "gemma2", "llama", "qwen2-tied")


@pytest.mark.e2e
@pytest.mark.parametrize("family", [f if f in DEFAULT_TIER else pytest.param(f, marks=pytest.mark.slow)
                                    for f in FAMILIES])
def test_three_lora_ppo_steps(cluster, tmp_path, family):
    argv = [f"run.dir={tmp_path}", "run.name=lora", f"model.policy={build_family_policy(family)}", "run.steps=3",
            "run.eval_every=0", "run.samples_every=0", "run.plot_every=0", "data.prompts_per_step=8",
            "learner.lora.rank=8", "learner.optim.lr=5e-3", "model.dtype=float32"]
    assert train.main(argv) == 0
    run_dir = tmp_path / "lora"
    steps = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if m["step"] > 0]
    gaps = [m["ppo/logprob_gap_mean"] for m in steps]
    print(f"family-table {family} LoRA: 3 steps, push {steps[0]['perf/sync_bytes'] / 1e3:.0f} kB, "
          f"logprob gap {max(gaps):.1e}, kl {[round(m['kl/mean'], 4) for m in steps]}")
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(g < 1e-3 for g in gaps)
    assert steps[-1]["kl/mean"] != 0.0 and np.isfinite(steps[-1]["kl/mean"])  # the policy left the base
    adapter = run_dir / "checkpoints" / "final" / "adapter" / "adapter_config.json"
    targets = json.loads(adapter.read_text())["target_modules"]
    if family == "phi3":
        assert {"qkv_proj", "gate_up_proj"} <= set(targets)

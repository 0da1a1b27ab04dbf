"""Every model family tether is checked with, through the real weight path.

Per family (cluster/demo/families.py): a learner rank (a Ray actor, ZeRO-2 then ZeRO-3)
trains and pushes its weights (CPU transport) into a vLLM generator actor, as in a run.
After each push, vLLM's behaviour log-probs must match both the learner's own forward and a
plain Hugging Face forward of the learner's gathered LM tensors (eager attention, one
sequence at a time), and must have moved away from the previous policy's.

Prints one table row per family and stage: `family-table ...` (the family table in docs/guide/models.md).
"""
import numpy as np
import pytest
import torch
from helpers import make_rollouts, model_logprobs, sgd_config

from cluster.demo.families import FAMILIES, build_family_policy

pytestmark = pytest.mark.integration

GAP_TOL = 1e-3
# Longer than the families' 8-token sliding window, so windowed layers are exercised.
PROMPTS = ("the movie was great and i loved every minute of it", "a terrible, boring film",
           "i think that the actors were not good enough for this story")


def start_generator(policy):
    import ray

    from actors.generator import actor_class, engine_process_env

    env = engine_process_env(num_gpus=0, tensor_parallel=1)
    gen = actor_class().options(num_cpus=1, runtime_env={"env_vars": env}).remote(
        model=str(policy), sampling={"temperature": 1.0, "max_new_tokens": 12, "n": 2, "seed": 1},
        engine={"max_model_len": 128, "kv_cache_bytes": 16 << 20})
    ray.get(gen.health.remote())
    return gen


def learner_as_hf(policy, state: dict, tied: bool):
    """A plain HF causal LM holding the learner's LM tensors (``lm.`` names, as pushed without it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    lm_state = {k[len("lm."):]: v for k, v in state.items() if k.startswith("lm.")}
    lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(policy), attn_implementation="eager",
                                          dtype=torch.float32)
    missing, unexpected = lm.load_state_dict(lm_state, strict=False)
    assert not unexpected, f"learner tensors the HF model does not have: {unexpected}"
    assert set(missing) <= ({"lm_head.weight"} if tied else set()), f"not in the learner: {missing}"
    lm.tie_weights()
    return lm.eval()


def start_learner(policy, stage: int):
    import ray

    from learner.worker import LearnerWorker

    # An actor of its own, as in a run: its DeepSpeed engine goes with it when it is killed.
    return ray.remote(LearnerWorker).options(num_cpus=1, runtime_env={"env_vars": {"DS_ACCELERATOR": "cpu"}}).remote(
        rank=0, world_size=1, model=policy, config=sgd_config(zero_stage=stage, lr=1.0))


def max_gap(logprobs, rollouts) -> float:
    return max(float(np.abs(lp - r.behaviour_logprobs).max()) for lp, r in zip(logprobs, rollouts))


# The default tier pushes into the families whose weight path has something of its own
# (tied heads, soft-capping, fused projections, Conv1D, vLLM's Transformers backend); Llama,
# the untied Qwen2, Mistral and Gemma-3 load as those do, and are pushed in the slow tier.
SLOW_TIER = ("llama", "qwen2-untied", "mistral", "gemma3")


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f in SLOW_TIER else f
                                    for f in FAMILIES])
def test_pushed_weights_serve_the_learners_policy(ray_local, family):
    import ray
    from transformers import AutoConfig, AutoTokenizer

    policy = str(build_family_policy(family))
    tok = AutoTokenizer.from_pretrained(policy)
    prompts = [np.asarray(tok(t)["input_ids"]) for t in PROMPTS]
    learners = {stage: start_learner(policy, stage) for stage in (2, 3)}  # they load while vLLM starts
    gen = start_generator(policy)
    tied = bool(AutoConfig.from_pretrained(policy).tie_word_embeddings)
    try:
        for stage, version in ((2, 1), (3, 2)):
            learner = learners[stage]
            ray.get(learner.train.remote(make_rollouts(policy, 8, seed=10 + stage)))
            stale = ray.get(gen.generate.remote(prompts)).rollouts
            stale_gap = max_gap(ray.get(learner.evaluate.remote(stale)), stale)

            report = ray.get(learner.push_weights.remote({"generator-0": gen}, version=version))
            fresh = ray.get(gen.generate.remote(prompts)).rollouts
            learner_gap = max_gap(ray.get(learner.evaluate.remote(fresh)), fresh)
            hf = learner_as_hf(policy, ray.get(learner.full_state_dict.remote()), tied)
            hf_gap = max_gap(model_logprobs(hf, [r.prompt_ids for r in fresh], [r.response_ids for r in fresh]),
                             fresh)
            print(f"family-table {family} ZeRO-{stage}: {report['bytes'] / 1e6:.2f} MB pushed; vLLM vs learner "
                  f"{learner_gap:.1e}, vs HF forward {hf_gap:.1e} (before the push {stale_gap:.2f})")
            assert stale_gap > 1e-2, "the update must change the policy for this test to mean anything"
            assert learner_gap < GAP_TOL and hf_gap < GAP_TOL
            assert report["version"] == version and all(r.policy_version == version for r in fresh)
    finally:
        for actor in [gen, *learners.values()]:
            ray.kill(actor)

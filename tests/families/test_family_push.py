"""Every model family tether is checked with, through the real weight path.

Per family (cluster/demo/families.py): a learner trains (ZeRO-2, then ZeRO-3) and pushes its
weights the CPU transport's way into a vLLM generator running as a Ray actor, as in a run.
After each push, vLLM's behaviour log-probs must match both the learner's own forward and a
plain Hugging Face forward of exactly the tensors that were pushed (eager attention, one
sequence at a time), and must have moved away from the previous policy's.

Prints one table row per family and stage: `family-table ...` (README's family table).
"""
import numpy as np
import pytest
import torch
from helpers import make_rollouts, model_logprobs, sgd_config

from cluster.demo.families import FAMILIES, build_family_policy
from core.weights import WeightReceiver, remote_method
from learner.weight_sync import policy_weights, to_buckets
from learner.worker import LearnerWorker

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


def pushed_model(policy, buckets, tied: bool):
    """A plain HF causal LM holding exactly the pushed tensors (names as in an HF checkpoint)."""
    from safetensors.torch import load
    from transformers import AutoConfig, AutoModelForCausalLM

    sent = {k: v for b in buckets for k, v in load(b).items()}
    lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(policy), attn_implementation="eager",
                                          dtype=torch.float32)
    missing, unexpected = lm.load_state_dict(sent, strict=False)
    assert not unexpected, f"pushed tensors the HF model does not have: {unexpected}"
    assert set(missing) <= ({"lm_head.weight"} if tied else set()), f"not pushed: {missing}"
    lm.tie_weights()
    return lm.eval()


def max_gap(logprobs, rollouts) -> float:
    return max(float(np.abs(lp - r.behaviour_logprobs).max()) for lp, r in zip(logprobs, rollouts))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_pushed_weights_serve_the_learners_policy(ray_local, family):
    import ray
    from transformers import AutoTokenizer

    policy = str(build_family_policy(family))
    tok = AutoTokenizer.from_pretrained(policy)
    prompts = [np.asarray(tok(t)["input_ids"]) for t in PROMPTS]
    gen = start_generator(policy)
    try:
        for stage, version in ((2, 1), (3, 2)):
            learner = LearnerWorker(rank=0, world_size=1, model=policy, config=sgd_config(zero_stage=stage, lr=1.0))
            learner.train(make_rollouts(policy, 8, seed=10 + stage))
            stale = ray.get(gen.generate.remote(prompts)).rollouts
            stale_gap = max_gap(learner.policy_logprobs(stale), stale)

            named = policy_weights(learner.named_weights(), tied_embeddings=learner.tied_embeddings)
            buckets = to_buckets(named)
            answer = ray.get(remote_method(gen, WeightReceiver.load_weights).remote(version, buckets))
            fresh = ray.get(gen.generate.remote(prompts)).rollouts
            learner_gap = max_gap(learner.policy_logprobs(fresh), fresh)
            hf = pushed_model(policy, buckets, learner.tied_embeddings)
            hf_gap = max_gap(model_logprobs(hf, [r.prompt_ids for r in fresh], [r.response_ids for r in fresh]),
                             fresh)
            print(f"family-table {family} ZeRO-{stage}: {answer['tensors']} tensors pushed; vLLM vs learner "
                  f"{learner_gap:.1e}, vs HF forward {hf_gap:.1e} (before the push {stale_gap:.2f})")
            assert stale_gap > 1e-2, "the update must change the policy for this test to mean anything"
            assert learner_gap < GAP_TOL and hf_gap < GAP_TOL
            assert answer["version"] == version and all(r.policy_version == version for r in fresh)
    finally:
        ray.kill(gen)

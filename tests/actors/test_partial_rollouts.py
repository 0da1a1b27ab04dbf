"""Partial rollouts: a weight push lands between two engine steps of a generate call.

Checked on the real vLLM CPU engine against Hugging Face forwards of the old and the new
weights: every token a rollout says version v sampled must have the behaviour logprob
that version v gives it, with v's own KV for the whole prefix (the push preempts and
recomputes the requests in flight). A push that kept the stale KV was 1.6-1.9 nats off here.
"""
import functools
import threading

import numpy as np
import pytest
import torch
from hf_reference import encode, hf_logprobs

from actors.engine_turns import EngineTurns
from actors.generator import Generator
from core.infra.weights import WEIGHT_UPDATE_GROUP
from learner.transport.base import policy_weights, to_buckets

pytestmark = pytest.mark.integration

PROMPTS = ["The cat was", "A dog seemed happy", "My friend felt", "The river"]
NEW_TOKENS = 48
PUSH_AFTER_STEPS = 12  # engine steps into the call (a step decodes one token of every request)


@pytest.fixture(scope="module")
def models(policy_path):
    """(old, new): the policy the engine starts with, and a perturbed one to push."""
    from transformers import AutoModelForCausalLM
    old = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return old, new


def buckets_of(model):
    return to_buckets(policy_weights(model.state_dict().items(), tied_embeddings=True), 256 << 10)


def land_next_update_after(turns: EngineTurns, steps: int) -> None:
    """Make the next weight update wait for `steps` more engine steps: deterministically mid-call."""
    turns.claim = functools.partial(EngineTurns.claim, turns, after_steps=turns.steps + steps)


def check_versions_and_logprobs(rollouts, old, new, versions=(0, 1)):
    """Each rollout: its token versions step once, old to new, mid-response, and each
    token's behaviour logprob is its own version's (HF forward of the whole prefix)."""
    for r in rollouts:
        k = int((r.token_versions == versions[0]).sum())
        assert 0 < k < NEW_TOKENS, r.token_versions
        assert r.token_versions.tolist() == [versions[0]] * k + [versions[1]] * (NEW_TOKENS - k)
        assert r.policy_version == versions[0] and r.partial
        assert np.abs(hf_logprobs(old, r)[:k] - r.behaviour_logprobs[:k]).max() < 1e-3
        assert np.abs(hf_logprobs(new, r)[k:] - r.behaviour_logprobs[k:]).max() < 1e-3


def test_push_lands_mid_generate_and_each_token_keeps_its_version(policy_path, tokenizer, models):
    """In this process, with vLLM's own engine process: the engine steps on its own there,
    so the push pauses it with the requests kept."""
    old, new = models
    gen = Generator(model=policy_path, partial_rollouts=True,
                    sampling={"max_new_tokens": NEW_TOKENS, "n": 2, "ignore_eos": True},
                    engine={"max_model_len": 128, "kv_cache_bytes": 16 << 20})
    try:
        out = {}
        land_next_update_after(gen._turns, PUSH_AFTER_STEPS)
        call = threading.Thread(target=lambda: out.update(result=gen.generate(encode(tokenizer, PROMPTS))))
        call.start()
        report = gen.load_weights(1, buckets_of(new))
        call.join()
        assert report["version"] == 1 and gen.health()["pushes_mid_generate"] == 1
        check_versions_and_logprobs(out["result"].rollouts, old, new)

        after = gen.generate(encode(tokenizer, PROMPTS)).rollouts  # no push: all version 1
        assert all(not r.partial and set(r.token_versions) == {1} for r in after)
    finally:
        gen._llm.llm_engine.engine_core.shutdown()


@pytest.fixture
def generator_plain(policy_path):
    gen = Generator(model=policy_path, sampling={"max_new_tokens": NEW_TOKENS, "n": 2, "ignore_eos": True},
                    engine={"max_model_len": 128, "kv_cache_bytes": 16 << 20})
    yield gen
    gen._llm.llm_engine.engine_core.shutdown()


# The slow tier: the contrast case. The default tier: test_push_lands_mid_generate_and_each_token_keeps_its_version.
@pytest.mark.slow
def test_without_partial_rollouts_a_push_waits_for_the_whole_call(generator_plain, tokenizer, models):
    old, new = models
    gen = generator_plain
    out = {}
    with gen._turns._cond:  # the call holds the engine's turn for its whole length
        call = threading.Thread(target=lambda: out.update(result=gen.generate(encode(tokenizer, PROMPTS))))
        call.start()
        assert gen._turns._cond.wait_for(lambda: gen._turns.busy, timeout=60)
    gen.load_weights(1, buckets_of(new))
    assert not call.is_alive()  # the push returned only after the call
    rollouts = out["result"].rollouts
    assert all(set(r.token_versions) == {0} and r.policy_version == 0 for r in rollouts)
    assert max(np.abs(hf_logprobs(old, r) - r.behaviour_logprobs).max() for r in rollouts) < 1e-3


# The slow tier. The default tier: test_push_lands_mid_generate_and_each_token_keeps_its_version (the push
# mid-generate), tests/e2e/test_episodes_run.py::test_episodes_in_async_mode_span_weight_pushes (pushes into
# generator actors as they generate, partial rollouts on).
@pytest.mark.slow
def test_generator_actor_takes_a_push_mid_generate(policy_path, tokenizer, models):
    """As the pools start it on CPU: a Ray actor with its engine in its own process, weight
    updates in their concurrency group, and pushes from the learner's side of Ray."""
    import ray

    from cluster.config.ppo import load_config
    from cluster.runtime.pools.pool import pool_env

    class MidCallPushGenerator(Generator):  # local: Ray ships it by value to the worker
        def land_next_update_after(self, steps: int) -> None:
            self._turns.claim = functools.partial(EngineTurns.claim, self._turns,
                                                  after_steps=self._turns.steps + steps)

    old, new = models
    cfg = load_config(None, ["run.mode=async"])
    env = pool_env(cfg, "generator", 1)
    import rays
    rays.shared()
    gen = ray.remote(concurrency_groups={WEIGHT_UPDATE_GROUP: 1})(MidCallPushGenerator).options(
        num_cpus=1, runtime_env={"env_vars": env}).remote(
        model=policy_path, partial_rollouts=True, engine={"max_model_len": 128, "kv_cache_bytes": 16 << 20},
        sampling={"max_new_tokens": NEW_TOKENS, "n": 2, "ignore_eos": True})
    try:
        ray.get(gen.land_next_update_after.remote(PUSH_AFTER_STEPS))
        call = gen.generate.remote(encode(tokenizer, PROMPTS))
        push = gen.load_weights.options(concurrency_group=WEIGHT_UPDATE_GROUP).remote(2, ray.put(buckets_of(new)))
        assert ray.get(push)["version"] == 2
        check_versions_and_logprobs(ray.get(call).rollouts, old, new, versions=(0, 2))
        assert ray.get(gen.health.remote())["pushes_mid_generate"] == 1
    finally:
        ray.kill(gen)

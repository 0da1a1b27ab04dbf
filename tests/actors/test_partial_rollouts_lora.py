"""Partial rollouts with LoRA: an adapter push lands between two engine steps of a generate call.

The engine's one adapter slot is replaced in place, so the requests in flight go on under the new
adapter, preempted and recomputed as under new full weights: every token a rollout says version v
sampled has the log-prob that base + adapter v gives it (Hugging Face forwards of both adapters).
"""
import functools
import threading

import numpy as np
import pytest
import torch
from hf_reference import encode, hf_logprobs

from actors.engine_turns import EngineTurns
from actors.generator import Generator
from learner import lora as adapters
from learner.config import LoraConfig

pytestmark = pytest.mark.integration

PROMPTS = ["The cat was", "A dog seemed happy", "My friend felt", "The river"]
NEW_TOKENS = 48
PUSH_AFTER_STEPS = 12
LORA = LoraConfig(rank=8, alpha=16.0)


def adapted(policy_path, seed: int):
    """(base + a random adapter as a Hugging Face model, the adapter's PEFT files)."""
    from transformers import AutoModelForCausalLM

    lm = adapters.add_adapter(AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32).eval(), LORA)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=generator))
    state = adapters.adapter_state(lm.named_parameters())
    return lm, adapters.adapter_files(state, LORA, policy_path)


def test_adapter_push_lands_mid_generate_and_each_token_keeps_its_version(policy_path, tokenizer, in_process_engine):
    """With the engine in this process, as a CPU generator actor hosts it (tests/actors/test_partial_rollouts.py
    covers vLLM's own engine process)."""
    (old, old_files), (new, new_files) = adapted(policy_path, 1), adapted(policy_path, 2)
    gen = in_process_engine.hold(Generator(
        model=policy_path, partial_rollouts=True, sampling={"max_new_tokens": NEW_TOKENS, "n": 2, "ignore_eos": True},
        engine={"max_model_len": 128, "kv_cache_bytes": 16 << 20, "max_lora_rank": 8}))
    assert gen.load_adapter(1, old_files)["stale"] == []
    out = {}
    turns = gen._turns  # the next update waits for PUSH_AFTER_STEPS engine steps: mid-call for sure
    turns.claim = functools.partial(EngineTurns.claim, turns, after_steps=turns.steps + PUSH_AFTER_STEPS)
    call = threading.Thread(target=lambda: out.update(result=gen.generate(encode(tokenizer, PROMPTS))))
    call.start()
    report = gen.load_adapter(2, new_files)
    call.join()
    assert report["version"] == 2 and not report["stale"] and gen.health()["pushes_mid_generate"] == 1
    for r in out["result"].rollouts:
        k = int((r.token_versions == 1).sum())
        assert 0 < k < NEW_TOKENS and r.token_versions.tolist() == [1] * k + [2] * (NEW_TOKENS - k)
        assert np.abs(hf_logprobs(old, r)[:k] - r.behaviour_logprobs[:k]).max() < 1e-3
        assert np.abs(hf_logprobs(new, r)[k:] - r.behaviour_logprobs[k:]).max() < 1e-3

"""LoRA: the learner trains an adapter on a frozen base and pushes the adapter alone; a real vLLM
engine (CPU, LoRA enabled) serves base + adapter and proves what it holds.

One engine per module as a plain object; learners run in-process as rank 0 of a world of 1.
The Ray fan-out (AdapterSync) is the same call per generator, checked with check_adapter_report.
"""
import numpy as np
import pytest
import torch
from helpers import make_rollouts

from core.infra.weights import adapter_checksum
from learner import lora as adapters
from learner.config import LearnerConfig, LoraConfig, OptimConfig, PPOConfig
from learner.weight_sync import AdapterNotLoaded, check_adapter_report
from learner.worker import LearnerWorker

pytestmark = pytest.mark.integration

GAP_TOL = 1e-3  # fp32: learner and vLLM agree on the pushed policy's log-probs


def lora_config(*, zero_stage=2, rank=8, lr=1e-2, targets=("all-linear",)):
    return LearnerConfig(zero_stage=zero_stage, optim=OptimConfig(lr=lr, grad_clip=0.0),
                         lora=LoraConfig(rank=rank, alpha=16.0, target_modules=targets),
                         ppo=PPOConfig(ppo_epochs=2, minibatch_size=4, micro_batch_size=2, shuffle=False))


@pytest.fixture(scope="module")
def generator(policy_path):
    from actors.generator import Generator
    gen = Generator(model=policy_path, sampling={"temperature": 1.0, "max_new_tokens": 12, "n": 2, "seed": 1},
                    engine={"max_model_len": 128, "kv_cache_bytes": 16 << 20, "max_lora_rank": 8})
    yield gen
    try:  # stop the engine process now: at interpreter exit vLLM logs into pytest's closed streams
        gen._llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort
        pass


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [np.asarray(tokenizer(t)["input_ids"]) for t in ("The cat was", "A dog seemed happy", "My friend felt")]


def adapter_of(learner):
    """What the learner's push sends: (PEFT files, adapter modules)."""
    return learner.exporter.adapter_files()


def gap(learner, rollouts) -> float:
    learner_lp = learner.evaluate(rollouts)
    return max(float(np.abs(lp - r.behaviour_logprobs).max()) for lp, r in zip(learner_lp, rollouts))


@pytest.mark.parametrize("stage, version", [(2, 1), (3, 2)])
def test_adapter_push_lands_and_is_proven(generator, prompts, policy_path, stage, version):
    learner = LearnerWorker(rank=0, world_size=1, model=policy_path, config=lora_config(zero_stage=stage))
    health = learner.health()
    assert health["lora_rank"] == 8 and 0 < health["trainable_parameters"] < health["parameters"] / 5
    base = {n: p.detach().clone() for n, p in learner.engine.module.lm.named_parameters()
            if not adapters.is_adapter_param(n)} if stage != 3 else None
    learner.train(make_rollouts(policy_path, 8, seed=10 + stage))
    if base is not None:  # the base is frozen: only the adapter (and the value head) moved
        after = dict(learner.engine.module.lm.named_parameters())
        assert all(torch.equal(after[n], t) for n, t in base.items())
    stale_gap = gap(learner, generator.generate(prompts).rollouts)

    files, modules = adapter_of(learner)
    report = generator.load_adapter(version, files)
    check_adapter_report("generator", report, version=version, checksum=adapter_checksum(files), modules=modules)
    fresh = generator.generate(prompts).rollouts
    fresh_gap = gap(learner, fresh)
    full_bytes = 4 * adapters.parameter_counts(learner.engine.module.lm)[1]  # fp32
    print(f"ZeRO-{stage}: adapter push {report['bytes'] / 1e3:.1f} kB ({report['bytes'] / full_bytes:.1%} of the "
          f"LM's {full_bytes / 1e6:.2f} MB), {report['bound']} modules bound; gap before {stale_gap:.2e}, "
          f"after {fresh_gap:.2e}")
    assert stale_gap > 1e-2, "the update must change the policy for this test to mean anything"
    assert fresh_gap < GAP_TOL
    assert report["bound"] == modules > 0 and not report["unbound"] and not report["stale"]
    assert all(r.policy_version == version for r in fresh)


def test_a_stale_or_unbound_adapter_is_refused(generator, policy_path):
    learner = LearnerWorker(rank=0, world_size=1, model=policy_path, config=lora_config())
    learner.train(make_rollouts(policy_path, 8, seed=3))
    files, modules = adapter_of(learner)
    report = generator.load_adapter(5, files)
    sent = adapter_checksum(files)
    check_adapter_report("g", report, version=5, checksum=sent, modules=modules)
    with pytest.raises(AdapterNotLoaded, match="reports version 5"):
        check_adapter_report("g", report, version=6, checksum=sent, modules=modules)
    with pytest.raises(AdapterNotLoaded, match="received other files"):
        check_adapter_report("g", report, version=5, checksum="0" * 16, modules=modules)
    # An adapter whose module names the engine does not know binds nothing: the push must fail.
    renamed = adapters.adapter_files(
        {k.replace("self_attn", "attention"): v for k, v in adapters.adapter_state(
            (n, p) for n, p in learner.engine.module.lm.named_parameters() if adapters.is_adapter_param(n)).items()
         if "self_attn" in k}, learner.engine.module.lora, None)
    try:
        bad = generator.load_adapter(6, renamed)
    except Exception as e:  # noqa: BLE001 - vLLM may refuse the names itself: also not a silent base model
        assert "attention" in str(e) or "module" in str(e).lower()
    else:
        with pytest.raises(AdapterNotLoaded, match="bound 0 of"):
            check_adapter_report("g", bad, version=6, checksum=adapter_checksum(renamed), modules=modules)


def test_the_exported_adapter_loads_in_vllm_and_matches_the_merged_model(generator, prompts, policy_path, tmp_path):
    """checkpoints/final as a run writes it: the merged model (transformers) and the adapter alone
    (vLLM, as a user serves it) give the same log-probs; the merged one was merged in fp32."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    learner = LearnerWorker(rank=0, world_size=1, model=policy_path, config=lora_config())
    learner.train(make_rollouts(policy_path, 8, seed=7))
    out = Path(learner.save_pretrained_policy(tmp_path / "final"))
    files = {f.name: f.read_bytes() for f in (out / adapters.ADAPTER_DIR).iterdir()}
    report = generator.load_adapter(9, files)
    assert report["bound"] == 28 and not report["stale"]
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    rollouts = generator.generate(prompts).rollouts
    with torch.no_grad():
        for r in rollouts:
            ids = torch.as_tensor(np.concatenate([r.prompt_ids, r.response_ids]))[None]
            logits = merged(ids).logits[0, len(r.prompt_ids) - 1:-1].log_softmax(-1)
            hf = logits.gather(-1, torch.as_tensor(r.response_ids)[:, None])[:, 0].numpy()
            assert np.abs(hf - r.behaviour_logprobs).max() < GAP_TOL


def test_the_learner_scores_the_reference_with_its_adapter_off(policy_path):
    """The base with the adapter switched off is the reference: the learner's log-probs of it meet
    the reference pool's (a Reference on the base model) to 1e-5 in fp32, while the adapter's differ."""
    from actors.reference import Reference
    from learner.update import PPOObjective

    learner = LearnerWorker(rank=0, world_size=1, model=policy_path, config=lora_config())
    rollouts = make_rollouts(policy_path, 8, seed=5)
    learner.train(rollouts)
    mine = learner.apply(PPOObjective.reference_logprobs, rollouts)
    pool = Reference(model=policy_path, batch_size=4).reference_logprobs(rollouts)
    policy = learner.evaluate(rollouts)
    assert max(float(np.abs(a - b).max()) for a, b in zip(mine, pool)) < 1e-5
    assert max(float(np.abs(a - b).max()) for a, b in zip(policy, pool)) > 1e-3  # the adapter is on otherwise

"""LoRA: the learner trains an adapter on a frozen base (ZeRO 0 to 3) and pushes the adapter alone;
a real vLLM engine (CPU, LoRA enabled) serves base + adapter and proves what it holds.

One generator actor per module, as a job starts it; learners run in-process as rank 0 of a world
of 1, one DeepSpeed engine per ZeRO stage for the whole module (``trained``). Most tests load the
adapter with the generator's own call and check its proof with check_adapter_report; a push whose
proof fails goes through the learner's real push (AdapterSync) and the driver's.
"""
import itertools

import numpy as np
import pytest
import torch
from helpers import make_rollouts

from core.infra.weights import adapter_checksum
from learner import lora as adapters
from learner.config import LearnerConfig, LoraConfig, OptimConfig, PPOConfig
from learner.transport.base import AdapterNotLoaded, check_adapter_report
from learner.worker import LearnerWorker

pytestmark = pytest.mark.integration

GAP_TOL = 1e-3  # fp32: learner and vLLM agree on the pushed policy's log-probs


def lora_config(*, zero_stage=2, rank=8, lr=1e-2, targets=("all-linear",)):
    return LearnerConfig(zero_stage=zero_stage, optim=OptimConfig(lr=lr, grad_clip=0.0),
                         lora=LoraConfig(rank=rank, alpha=16.0, target_modules=targets),
                         ppo=PPOConfig(ppo_epochs=2, minibatch_size=4, micro_batch_size=2, shuffle=False))


@pytest.fixture(scope="module")
def generator(ray_cluster, policy_path):
    """A generator actor as the job starts one (its engine inside the actor on CPU)."""
    import ray

    from actors.generator import actor_class, engine_process_env

    gen = actor_class().options(num_cpus=1, runtime_env={"env_vars": engine_process_env(num_gpus=0, tensor_parallel=1)}
                                ).remote(model=policy_path, engine={"max_model_len": 128, "kv_cache_bytes": 16 << 20,
                                                                    "max_lora_rank": 8},
                                         sampling={"temperature": 1.0, "max_new_tokens": 12, "n": 2, "seed": 1})
    ray.get(gen.health.remote())
    yield gen
    ray.kill(gen)


@pytest.fixture(scope="module")
def versions():
    """The policy versions of the module's pushes to its one generator, rising in the order the
    tests run (a generator refuses an older version than the one it holds)."""
    return itertools.count(1)


def base_adapter(files: dict) -> dict:
    """``files`` with every lora_B zeroed: an adapter that leaves the base model as it is."""
    from safetensors.torch import load, save

    tensors = load(files["adapter_model.safetensors"])
    return {**files, "adapter_model.safetensors": save({k: torch.zeros_like(v) if "lora_B" in k else v
                                                         for k, v in tensors.items()})}


def load_adapter(generator, version, files) -> dict:
    import ray
    return ray.get(generator.load_adapter.remote(version, files))


def generate(generator, prompts) -> list:
    import ray
    return ray.get(generator.generate.remote(prompts)).rollouts


@pytest.fixture(scope="module")
def trained(policy_path):
    """trained(stage): (a learner under ZeRO-<stage> that trained its adapter on 8 rollouts, whether
    its base stayed as it was (None under ZeRO-3, whose partitions are not compared)), made once per
    stage for the whole module."""
    made = {}

    def get(stage):
        if stage not in made:
            learner = LearnerWorker(rank=0, world_size=1, model=policy_path, config=lora_config(zero_stage=stage))
            base = {n: p.detach().clone() for n, p in learner.engine.module.lm.named_parameters()
                    if not adapters.is_adapter_param(n)} if stage != 3 else None
            learner.train(make_rollouts(policy_path, 8, seed=10 + stage))
            after = dict(learner.engine.module.lm.named_parameters())
            made[stage] = learner, None if base is None else all(torch.equal(after[n], t) for n, t in base.items())
        return made[stage]
    return get


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [np.asarray(tokenizer(t)["input_ids"]) for t in ("The cat was", "A dog seemed happy", "My friend felt")]


def adapter_of(learner):
    """What the learner's push sends: (PEFT files, adapter modules)."""
    return learner.exporter.adapter_files()


def gap(learner, rollouts) -> float:
    learner_lp = learner.evaluate(rollouts)
    return max(float(np.abs(lp - r.behaviour_logprobs).max()) for lp, r in zip(learner_lp, rollouts))


# Every ZeRO stage: 0 and 1 keep the whole adapter on the rank as 2 does, 3 gathers it.
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_adapter_push_lands_and_is_proven(generator, prompts, trained, versions, stage):
    learner, base_unchanged = trained(stage)
    health = learner.health()
    assert health["lora_rank"] == 8 and 0 < health["trainable_parameters"] < health["parameters"] / 5
    assert base_unchanged in ((None,) if stage == 3 else (True,)), "the base is frozen: only the adapter moves"
    files, modules = adapter_of(learner)
    load_adapter(generator, next(versions), base_adapter(files))  # the generator samples the base model
    stale_gap = gap(learner, generate(generator, prompts))

    version = next(versions)
    report = load_adapter(generator, version, files)
    check_adapter_report("generator", report, version=version, checksum=adapter_checksum(files), modules=modules)
    fresh = generate(generator, prompts)
    fresh_gap = gap(learner, fresh)
    full_bytes = 4 * adapters.parameter_counts(learner.engine.module.lm)[1]  # fp32
    print(f"ZeRO-{stage}: adapter push {report['bytes'] / 1e3:.1f} kB ({report['bytes'] / full_bytes:.1%} of the "
          f"LM's {full_bytes / 1e6:.2f} MB), {report['bound']} modules bound; gap before {stale_gap:.2e}, "
          f"after {fresh_gap:.2e}")
    assert stale_gap > 1e-2, "the update must change the policy for this test to mean anything"
    assert fresh_gap < GAP_TOL
    assert report["bound"] == modules > 0 and not report["unbound"] and not report["stale"]
    assert all(r.policy_version == version for r in fresh)


def test_a_stale_or_unbound_adapter_is_refused(generator, trained, versions):
    learner, _ = trained(2)
    files, modules = adapter_of(learner)
    v = next(versions)
    report = load_adapter(generator, v, files)
    sent = adapter_checksum(files)
    check_adapter_report("g", report, version=v, checksum=sent, modules=modules)
    with pytest.raises(AdapterNotLoaded, match=f"reports version {v}"):
        check_adapter_report("g", report, version=v + 1, checksum=sent, modules=modules)
    with pytest.raises(AdapterNotLoaded, match="received other files"):
        check_adapter_report("g", report, version=v, checksum="0" * 16, modules=modules)
    # An adapter whose module names the engine does not know binds nothing: the push must fail.
    renamed = adapters.adapter_files(
        {k.replace("self_attn", "attention"): v for k, v in adapters.adapter_state(
            (n, p) for n, p in learner.engine.module.lm.named_parameters() if adapters.is_adapter_param(n)).items()
         if "self_attn" in k}, learner.engine.module.lora, None)
    try:
        bad_version = next(versions)
        bad = load_adapter(generator, bad_version, renamed)
    except Exception as e:  # noqa: BLE001 - vLLM may refuse the names itself: also not a silent base model
        assert "attention" in str(e) or "module" in str(e).lower()
    else:
        with pytest.raises(AdapterNotLoaded, match="bound 0 of"):
            check_adapter_report("g", bad, version=bad_version, checksum=adapter_checksum(renamed), modules=modules)


def test_a_push_whose_proof_fails_ends_the_job(generator, trained, versions, monkeypatch):
    """The learner's real push (AdapterSync, through the generator actor) of an adapter whose
    attention modules carry names this model's engine lacks: the engine binds the rest, its proof
    says so, and the driver's push (cluster/runtime/loop/recovery.py) raises AdapterNotLoaded with
    the generator alive, which ends the job as a failure in one line."""
    from cluster.job.errors import EXIT_FAILED, exit_status
    from cluster.runtime.loop import recovery

    learner, _ = trained(2)
    real = adapters.adapter_files

    def misnamed(state, *args, **kwargs):
        return real({k.replace("self_attn", "attention"): v for k, v in state.items()}, *args, **kwargs)

    monkeypatch.setattr(adapters, "adapter_files", misnamed)
    v = next(versions)
    with pytest.raises(AdapterNotLoaded, match=rf"^LoRA push of version {v}: generator generator-0 bound 12 of 28 "
                                               r"adapter modules; not bound: model\.layers\.0\.attention\.") as failed:
        recovery.push_weights(learner, {"generator-0": generator}, v)
    code, line = exit_status(failed.value)
    print(f"the job's last line: tether: {line}")
    assert code == EXIT_FAILED and "\n" not in line
    assert line.startswith(f"run failed: LoRA push of version {v}: generator generator-0 bound 12 of 28")


def test_the_exported_adapter_loads_in_vllm_and_matches_the_merged_model(generator, prompts, trained, versions,
                                                                          tmp_path):
    """checkpoints/final as a run writes it: the merged model (transformers) and the adapter alone
    (vLLM, as a user serves it) give the same log-probs; the merged one was merged in fp32."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    learner, _ = trained(2)
    out = Path(learner.save_pretrained_policy(tmp_path / "final"))
    files = {f.name: f.read_bytes() for f in (out / adapters.ADAPTER_DIR).iterdir()}
    report = load_adapter(generator, next(versions), files)
    assert report["bound"] == 28 and not report["stale"]
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    rollouts = generate(generator, prompts)
    with torch.no_grad():
        for r in rollouts:
            ids = torch.as_tensor(np.concatenate([r.prompt_ids, r.response_ids]))[None]
            logits = merged(ids).logits[0, len(r.prompt_ids) - 1:-1].log_softmax(-1)
            hf = logits.gather(-1, torch.as_tensor(r.response_ids)[:, None])[:, 0].numpy()
            assert np.abs(hf - r.behaviour_logprobs).max() < GAP_TOL


def test_the_learner_scores_the_reference_with_its_adapter_off(policy_path, trained):
    """The base with the adapter switched off is the reference: the learner's log-probs of it meet
    the reference pool's (a Reference on the base model) to 1e-5 in fp32, while the adapter's differ."""
    from actors.reference import Reference
    from learner.objectives.ppo import PPOObjective

    learner, _ = trained(2)
    rollouts = make_rollouts(policy_path, 8, seed=5)
    mine = learner.apply(PPOObjective.reference_logprobs, rollouts)
    pool = Reference(model=policy_path, batch_size=4).reference_logprobs(rollouts)
    policy = learner.evaluate(rollouts)
    assert max(float(np.abs(a - b).max()) for a, b in zip(mine, pool)) < 1e-5
    assert max(float(np.abs(a - b).max()) for a, b in zip(policy, pool)) > 1e-3  # the adapter is on otherwise

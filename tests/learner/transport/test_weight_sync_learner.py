"""Learner -> real vLLM generator: after an update and a push, vLLM samples from the new policy.

One CPU vLLM engine (module-scoped, ~30 s to start) as a plain object; learners run
in-process as rank 0 of a world of 1, with ZeRO-2 and with ZeRO-3 (gathered weights).
The weights travel by the CPU transport's building blocks (gathered tensors -> safetensors
buckets -> Generator.load_weights); the Ray fan-out around them is tested in test_worker.py.
"""
import itertools

import numpy as np
import pytest
from helpers import make_rollouts, sgd_config

from learner.transport.base import DEFAULT_BUCKET_BYTES, policy_weights, to_buckets
from learner.worker import LearnerWorker

pytestmark = pytest.mark.integration

GAP_TOL = 1e-3
# Each push's version, rising in run order whatever order the tests run in (the generator refuses
# a version older than the one it holds).
VERSIONS = itertools.count(1)


@pytest.fixture(scope="module")
def generator(policy_path):
    from actors.generator import Generator
    gen = Generator(model=policy_path, sampling={"temperature": 1.0, "max_new_tokens": 12, "n": 2, "seed": 1},
                    engine={"max_model_len": 128, "kv_cache_bytes": 16 << 20})
    yield gen
    try:  # stop the engine process now: at interpreter exit vLLM logs into pytest's closed streams
        gen._llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort
        pass


@pytest.fixture(scope="module")
def prompts(policy_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(policy_path)
    return [np.asarray(tok(t)["input_ids"]) for t in ("The cat was", "A dog seemed happy", "My friend felt")]


def push(learner, generator, version, bucket_bytes=DEFAULT_BUCKET_BYTES) -> tuple[list[bytes], dict]:
    """What CPUWeightSync does for one generator, without Ray: (buckets, the generator's answer)."""
    named = policy_weights(learner.named_weights(bucket_bytes), tied_embeddings=learner.tied_embeddings)
    buckets = to_buckets(named, bucket_bytes)
    return buckets, generator.load_weights(version, buckets)


def gap(learner, rollouts) -> float:
    learner_lp = learner.evaluate(rollouts)
    return max(float(np.abs(lp - r.behaviour_logprobs).max()) for lp, r in zip(learner_lp, rollouts))


@pytest.mark.parametrize("stage", [2, 3])
def test_generator_samples_from_pushed_policy(generator, prompts, policy_path, stage):
    version = next(VERSIONS)
    learner = LearnerWorker(rank=0, world_size=1, model=policy_path, config=sgd_config(zero_stage=stage, lr=1.0))
    learner.train(make_rollouts(policy_path, 8, seed=10 + stage))
    stale = generator.generate(prompts).rollouts  # still the previous weights
    stale_gap = gap(learner, stale)

    buckets, answer = push(learner, generator, version)
    fresh = generator.generate(prompts).rollouts
    fresh_gap = gap(learner, fresh)
    print(f"ZeRO-{stage}: {sum(map(len, buckets)) / 1e6:.2f} MB in {len(buckets)} bucket(s); "
          f"vLLM vs learner logprob gap before push {stale_gap:.2e}, after {fresh_gap:.2e}")
    assert stale_gap > 1e-2, "the update must change the policy for this test to mean anything"
    assert fresh_gap < GAP_TOL
    assert answer["version"] == version and generator.version() == version
    assert all(r.policy_version == version for r in fresh)


def test_push_in_small_buckets_and_version_order(generator, prompts, policy_path):
    learner = LearnerWorker(rank=0, world_size=1, model=policy_path, config=sgd_config(zero_stage=3, lr=1.0))
    learner.train(make_rollouts(policy_path, 8, seed=20))
    # Tiny buckets: ZeRO-3 gathers (and the sync sends) many groups; the result must not change.
    version = next(VERSIONS)
    buckets, _ = push(learner, generator, version=version, bucket_bytes=64 << 10)
    assert len(buckets) > 1
    assert gap(learner, generator.generate(prompts).rollouts) < GAP_TOL
    with pytest.raises(ValueError, match="older than the loaded version"):
        push(learner, generator, version=version - 1)

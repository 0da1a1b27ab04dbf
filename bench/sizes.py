"""Policy sizes for the learner benches: the workload's 31.7M policy, or bigger Qwen2-shaped ones.

On a GPU the 31.7M workload policy is too small to mean much (launch overhead, not matmuls,
sets its time), so ``mid`` and ``large`` swap in bigger random-weight models, built offline
from a config by cluster.demo.tiny_models (no download) and cached like the workload's.
Only the models change: the prompts stay the workload's token ids. Those come from the
workload's small tokenizer and are valid ids in any of these vocabularies; the learner
never tokenizes (the benches hand it ids), so a model's vocabulary may be larger than its
tokenizer's, as the workload's own 512-entry one already is.
"""
from __future__ import annotations

from typing import Optional

from cluster.demo.tiny_models import TinySpec, build_policy, build_reward_model

# None: bench/workload.py's policy as it is (the default everywhere).
SIZES: dict[str, Optional[TinySpec]] = {
    "bench": None,
    # ~0.17B: a 32k vocabulary, 12 layers of 1024.
    "mid": TinySpec(vocab_size=32768, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                    num_attention_heads=16, num_key_value_heads=4),
    # ~0.49B: Qwen2.5-0.5B's shape (its 151,936-entry vocabulary, 24 layers of 896, GQA 14/2, tied
    # embeddings), so the LM head and the log-softmax weigh what they weigh in a real run.
    "large": TinySpec(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2),
}


def sized_workload(wl: dict, size: str, *, with_value: bool = True) -> dict:
    """The workload dict ``wl`` (bench/workload.py's workload.json) with the policy (also the
    reference) and, if ``with_value``, the reward/value model of ``size``. Builds what is not
    cached yet: a few seconds for ``mid``, ~15 s a model for ``large`` on 2 cores."""
    if size not in SIZES:
        raise ValueError(f"bench: policy size {size!r} is not one of {list(SIZES)}")
    spec = SIZES[size]
    if spec is None:
        return wl
    policy = str(build_policy(spec))
    out = {**wl, "policy": policy, "reference": policy, "vocab_size": spec.vocab_size}
    # The separate critic's body; not built for a shared critic (it is a second model this size).
    value = str(build_reward_model(spec)) if with_value else None
    return {**out, "reward": value, "value": value}

"""What one generate call returns, and the seed and version of each sampled token.

``GenerationSummary`` is what travels to the driver (counts, never the rollouts);
``request_seed`` seeds one request by what it is (a prompt, or an episode turn) and the
policy version, never by which replica draws it; ``token_versions`` reads vLLM's labels of
which policy version sampled each token.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.rollout import Rollout


def request_seed(seed: int, version: int, *key: int) -> int:
    """The sampling seed of one request at one policy version (a 31-bit int); ``key``: a prompt's
    index, or an episode turn's (prompt index, sample index, turn)."""
    return int(np.random.SeedSequence([seed, version, *key]).generate_state(1)[0] >> 1)


@dataclass(frozen=True)
class GenerationSummary:
    """What the driver needs to know about one generate call: counts, never the rollouts."""
    rollouts: int                    # rollouts produced
    skipped_prompts: tuple = ()      # prompt indices too long for the model
    generated_tokens: int = 0
    seconds: float = 0.0
    version: int = 0                 # policy version that sampled them
    incomplete_kept_sets: int = 0    # positions whose kept set may hold more than was read (actors/kept_set.py)
    episode_counts: tuple = ()       # multi-turn episodes: (name, number) pairs (actors/environments/episodes.py)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class GenerationResult:
    """One generate call: its rollouts, and the summary that travels to the driver instead of them."""
    rollouts: list[Rollout]
    summary: GenerationSummary


def token_versions(spans, n_tokens: int, default: int) -> np.ndarray:
    """[n_tokens] int64 version of each output token, from vLLM's WeightVersionSpan list
    (labels are our version numbers, set by EngineWeights); ``default`` where vLLM gave none."""
    out = np.full(n_tokens, default, dtype=np.int64)
    for span in spans or ():
        out[span.start:span.end] = int(span.version)
    return out

"""The data units that flow from the rollout side to the learner.

Arrays are numpy (cheap to pickle through Ray's object store, no torch needed on
the consumer to read them). Shapes: P = prompt length, R = response length of
this one rollout (no padding inside a unit; padding happens when a batch is made).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FINISH_REASONS = ("stop", "length")


@dataclass
class Rollout:
    """One sampled response to one prompt, as the generator produced it."""
    prompt_ids: np.ndarray          # [P] int64: prompt tokens
    response_ids: np.ndarray        # [R] int64: sampled tokens, EOS included when finish_reason == "stop"
    behaviour_logprobs: np.ndarray  # [R] float32: log pi_behaviour(token) under the tempered sampling distribution
    finish_reason: str              # "stop" (EOS or stop string) | "length" (cut at max_new_tokens)
    policy_version: int             # version of the weights that sampled it
    prompt_index: int               # position of the prompt in the driver's batch / dataset
    sample_index: int               # which of the n samples for that prompt

    def __post_init__(self) -> None:
        self.prompt_ids = np.asarray(self.prompt_ids, dtype=np.int64)
        self.response_ids = np.asarray(self.response_ids, dtype=np.int64)
        self.behaviour_logprobs = np.asarray(self.behaviour_logprobs, dtype=np.float32)
        if self.response_ids.shape != self.behaviour_logprobs.shape:
            raise ValueError(f"Rollout: response_ids shape {self.response_ids.shape} does not match "
                             f"behaviour_logprobs shape {self.behaviour_logprobs.shape}")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"Rollout: finish_reason {self.finish_reason!r} is not one of {FINISH_REASONS}")

    @property
    def truncated(self) -> bool:
        """Cut at max length without EOS: gets the configured truncation penalty."""
        return self.finish_reason == "length"


@dataclass
class ScoredRollout(Rollout):
    """A Rollout annotated by the reference and reward pools; what the learner trains on."""
    reference_logprobs: np.ndarray = None  # [R] float32: log pi_ref(token), same temperature convention
    kl: np.ndarray = None                  # [R] float32: per-token KL estimate (behaviour vs reference)
    rewards: np.ndarray = None             # [R] float32: -beta*kl_t, plus the score on the last token
    score: float = 0.0                     # reward-model / reward-function score of the whole sequence

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("reference_logprobs", "kl", "rewards"):
            arr = np.asarray(getattr(self, name), dtype=np.float32)
            if arr.shape != self.response_ids.shape:
                raise ValueError(f"ScoredRollout: {name} shape {arr.shape} does not match "
                                 f"response_ids shape {self.response_ids.shape}")
            setattr(self, name, arr)

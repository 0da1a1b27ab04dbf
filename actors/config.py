"""The generator's settings: how it samples and how its vLLM engine is sized. Plain dataclasses
with no torch or vLLM import, so a run's config can be built and checked without either."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0       # behaviour logprobs are of the tempered distribution
    top_p: float = 1.0             # nucleus sampling; reference and learner score the same truncation
    top_k: int = 0                 # 0 disables top-k; truncation is scored alike everywhere (core/sampling.py)
    max_new_tokens: int = 64
    n: int = 1                     # samples per prompt
    seed: int = 0                  # sampling seed; each prompt's is drawn from (seed, version, prompt index)
    ignore_eos: bool = False       # every response runs to max_new_tokens (fixed-length benchmarks); EOS is samplable

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"sampling.temperature must be > 0 (got {self.temperature}); "
                             "PPO needs a stochastic behaviour policy")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1] (got {self.top_p})")
        if self.max_new_tokens < 1 or self.n < 1 or self.top_k < 0:
            raise ValueError("sampling.max_new_tokens and sampling.n must be >= 1, top_k >= 0")


@dataclass(frozen=True)
class EngineConfig:
    dtype: str = "float32"
    max_model_len: int = 512
    kv_cache_bytes: int = 64 << 20  # explicit size: the fraction-of-memory knob breaks a 2nd engine on CPU
    max_num_seqs: int = 64
    enforce_eager: bool = True      # no torch.compile: engine start dominates at tiny sizes
    gpu_memory_utilization: float = 0.5  # GPU only: fraction of the device vLLM may take

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"generator.engine.gpu_memory_utilization={self.gpu_memory_utilization} "
                             "must be in (0, 1]")

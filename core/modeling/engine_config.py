"""The generator's settings: how it samples and how its vLLM engine is sized. Plain dataclasses
with no torch or vLLM import, so a run's config can be built and checked without either."""
from __future__ import annotations

from typing import Optional

from core.choices import ENGINE_LORA_RANKS
from core.infra.dtypes import DTYPES
from core.infra.schema import config_class, setting


@config_class
class SamplingConfig:
    """How the generator samples: temperature, truncation, length, samples per prompt."""
    temperature: float = setting(1.0, "sampling temperature; behaviour logprobs are of the tempered distribution")
    top_p: float = setting(1.0, "nucleus sampling; reference and learner score the same truncation")
    top_k: int = setting(0, "0 disables top-k; truncation is scored alike everywhere (core/sampling.py)")
    max_new_tokens: int = setting(64, "response length cap in tokens")
    n: int = setting(1, "samples per prompt")
    seed: int = setting(0, "sampling seed; each prompt's is drawn from (seed, version, prompt index)")
    ignore_eos: bool = setting(False, "every response runs to max_new_tokens (fixed-length benchmarks); "
                                      "EOS is samplable")

    def check(self, at: str) -> None:
        """ValueError naming the key as the user wrote it: ``at`` is this section's dotted path
        (generator.sampling in a PPO job). The config loader calls it on every section it builds."""
        if self.temperature <= 0:
            raise ValueError(f"{at}.temperature must be > 0 (got {self.temperature}); "
                             "PPO needs a stochastic behaviour policy")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"{at}.top_p must be in (0, 1] (got {self.top_p})")
        if self.max_new_tokens < 1 or self.n < 1 or self.top_k < 0:
            raise ValueError(f"{at}.max_new_tokens and {at}.n must be >= 1, {at}.top_k >= 0")


@config_class
class EngineConfig:
    """How the generator's vLLM engine is sized."""
    dtype: Optional[str] = setting(None, "vLLM's weight and activation dtype (float32, bfloat16, float16); "
                                         "null = model.dtype (float32 for an engine started on its own)")
    max_model_len: int = setting(512, "context length: prompt + response tokens")
    kv_cache_bytes: int = setting(64 << 20, "KV cache size in bytes; explicit: the fraction-of-memory knob "
                                            "breaks a 2nd engine on CPU")
    max_num_seqs: int = setting(64, "sequences the engine schedules at once")
    block_size: Optional[int] = setting(None, "KV cache block in tokens; the prefix cache keeps whole blocks only, so "
                                              "a transcript shorter than a block is prefilled again each turn; a "
                                              "multiple of 32. null = 32 on CPU (vLLM's CPU default, 128, keeps no "
                                              "short transcript), vLLM's default on a GPU")
    enforce_eager: bool = setting(True, "no torch.compile: engine start dominates at tiny sizes")
    gpu_memory_utilization: float = setting(0.5, "GPU only: fraction of the device vLLM may take")
    max_lora_rank: int = setting(0, "the largest LoRA adapter rank the engine serves; 0 = no adapters (a job "
                                    "with learner.lora sets it from learner.lora.rank)")

    def check(self, at: str) -> None:
        """As SamplingConfig.check: ``at`` is this section's dotted path (generator.engine,
        reward.judge.engine)."""
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"{at}.dtype={self.dtype!r} is not one of {list(DTYPES)} "
                             "(or null to follow model.dtype)")
        if self.max_lora_rank and self.max_lora_rank not in ENGINE_LORA_RANKS:
            raise ValueError(f"{at}.max_lora_rank={self.max_lora_rank} is not a rank vLLM serves; use 0 or one "
                             f"of {list(ENGINE_LORA_RANKS)}")
        if self.block_size is not None and (self.block_size < 32 or self.block_size % 32):
            raise ValueError(f"{at}.block_size={self.block_size} is not a block every vLLM backend takes: use a "
                             "multiple of 32 (vLLM's CPU attention needs one), or null")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"{at}.gpu_memory_utilization={self.gpu_memory_utilization} "
                             "must be in (0, 1]")

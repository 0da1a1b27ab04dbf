"""The LoRA settings (``learner.lora``), a section of learner/config.py's TrainerConfig kept in a
file of its own; learner/lora.py puts them into the model."""
from __future__ import annotations

import math
from typing import Optional

from core.choices import ENGINE_LORA_RANKS, LoraInit
from core.infra.schema import check_choices, config_class, setting


def _fail(message: str) -> None:
    raise ValueError(message)


@config_class
class LoraConfig:
    """LoRA adapters: train low-rank adapters on a frozen base instead of every parameter (learner/lora.py)."""
    rank: int = setting(0, "adapter rank r; 0 = train every parameter (no adapters)")
    alpha: float = setting(16.0, "the adapter's update is (alpha / rank) x B A")
    dropout: float = setting(0.0, "dropout on the adapter's input; the sft and reward-model stages only (PPO "
                                  "scores tokens as the sampler did, without dropout)")
    target_modules: tuple[str, ...] = setting(("all-linear",), "module names (or name suffixes) that get an "
                                                                "adapter; all-linear = every linear layer but the "
                                                                "output head")
    init: LoraInit = setting("default", "default: A Kaiming-uniform | gaussian: A normal; B = 0 either way, so "
                                        "training starts at the base model")
    critic: bool = setting(False, "true (with learner.critic=separate): the critic's body trains as an adapter "
                                  "too, of this rank, alpha and targets (its value head in full); false: the body "
                                  "trains in full")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def engine_rank(self, served: int = 0) -> int:
        """The adapter rank the generators' engines start with: ``served`` (generator.engine.max_lora_rank)
        when set, else the smallest rank vLLM serves that holds ``rank``; 0 without adapters."""
        if self.enabled and served and self.rank > served:
            wanted = next(r for r in ENGINE_LORA_RANKS if r >= self.rank)
            _fail(f"learner.lora.rank={self.rank} is above generator.engine.max_lora_rank={served}, the largest "
                  f"adapter rank the generators' engines serve; raise max_lora_rank to {wanted} or set it to 0 to "
                  "follow learner.lora.rank")
        if served or not self.enabled:
            return served
        return next(r for r in ENGINE_LORA_RANKS if r >= self.rank)

    def validate(self, world_size: int = 1) -> None:
        p = "learner.lora"
        check_choices(self, p)
        if self.rank < 0 or self.rank > ENGINE_LORA_RANKS[-1]:
            _fail(f"{p}.rank={self.rank} must be in [0, {ENGINE_LORA_RANKS[-1]}] (0 = no adapters; vLLM serves "
                  f"ranks up to {ENGINE_LORA_RANKS[-1]})")
        if not self.enabled:
            return
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            _fail(f"{p}.alpha={self.alpha} must be a finite number > 0")
        if not 0 <= self.dropout < 1:
            _fail(f"{p}.dropout={self.dropout} must be in [0, 1)")
        if not self.target_modules or not all(isinstance(m, str) and m for m in self.target_modules):
            _fail(f"{p}.target_modules={list(self.target_modules)} must name modules, e.g. all-linear or "
                  "[q_proj, v_proj]")

    def check_critic(self, critic: Optional[str]) -> None:
        """``critic``: learner.critic. An adapter on the critic needs one on the policy (the run's
        checkpoints then keep what trains alone) and a critic body of its own."""
        if not self.critic:
            return
        if not self.enabled:
            _fail("learner.lora.critic=true trains the critic as an adapter beside the policy's; it needs "
                  "learner.lora.rank > 0: set a rank or learner.lora.critic=false")
        if critic != "separate":
            _fail(f"learner.lora.critic=true adapts a separate critic's body, but learner.critic={critic or 'null'} "
                  "has none; set learner.critic=separate (with learner.critic_model) or learner.lora.critic=false")

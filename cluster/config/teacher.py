"""The teacher section (on-policy distillation, core/distill.py): a frozen model whose
log-probs of the sampled tokens pull the policy toward it, and the checks on it."""
from __future__ import annotations

import math
from typing import Optional

from core.infra.schema import ConfigError, config_class, setting


@config_class
class TeacherConfig:
    """A frozen teacher: on-policy distillation of the policy toward it, with or without a reward."""
    model: Optional[str] = setting(None, "the teacher: a Hugging Face model directory or a builtin:* model sharing "
                                         "the policy's tokenizer; the reference replicas host it and score the "
                                         "sampled tokens under it (the reference's own model is scored once); "
                                         "null = no teacher")
    coef: float = setting(1.0, "lambda: each sampled token's advantage gets -lambda x (log pi_old - "
                               "log pi_teacher), the reverse-KL estimate of that token (slime's --opd-kl-coef)")

    @property
    def enabled(self) -> bool:
        return self.model is not None


def check_teacher(cfg) -> None:
    """One line naming the key and the fix for a teacher no run could use (``cfg``: a TetherConfig)."""
    t = cfg.teacher
    if not t.enabled:
        return
    if not (t.coef > 0 and math.isfinite(t.coef)):
        raise ConfigError(f"config: teacher.coef={t.coef} must be a finite number > 0 (the weight of the "
                          "teacher's term in the advantage)")
    if cfg.reference.on_learner:
        raise ConfigError("config: the teacher is hosted by the reference replicas, and reference.on_learner=true "
                          "starts none; set reference.on_learner=false")

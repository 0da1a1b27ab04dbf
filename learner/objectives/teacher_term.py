"""The teacher's term in a PPO update (on-policy distillation, core/distill.py): each sampled
token's advantage gets -teacher.coef x (log pi_old - log pi_teacher), and the step reports how
far the policy is from the teacher."""
from __future__ import annotations

from core.distill import distilled_advantages, teacher_kl
from learner.batch import Batch


def add_teacher_term(batch: Batch, coef: float, reduce) -> dict:
    """Fold the teacher's term into ``batch.advantages`` [B, R] (after the estimator's), from
    ``batch.old_logprobs`` and ``batch.teacher_logprobs``; returns the teacher/* metrics, token
    means over every rank (``reduce``: the sum over ranks of a list of numbers)."""
    if batch.teacher_logprobs is None:
        raise ValueError("learner: teacher.coef is set but the rollouts carry no teacher log-probs; the reference "
                         "replicas host the teacher (teacher.model)")
    mask = batch.response_mask
    kl = teacher_kl(batch.old_logprobs, batch.teacher_logprobs, mask)
    batch.advantages = distilled_advantages(batch.advantages, batch.old_logprobs, batch.teacher_logprobs, mask, coef)
    m = mask.double()
    n, s_kl, s_lp = reduce([m.sum(), kl.double().sum(), (batch.teacher_logprobs.double() * m).sum()])
    n = max(float(n), 1.0)
    return {"teacher/kl_mean": float(s_kl) / n, "teacher/logprob_mean": float(s_lp) / n}

"""On-policy distillation: a frozen teacher's log-probs of the tokens the student sampled turn
into a per-token term of the student's advantage. Conventions as in core.masked.

The student samples, the teacher scores the very tokens sampled, and each token's advantage
gets minus the reverse-KL estimate log pi_student - log pi_teacher, weighted by ``coef``
(slime's ``--opd-kl-coef``, verl's on-policy distillation, Tinker's "advantage = teacher
log-prob - student log-prob"). A token the teacher finds likelier than the student did is
reinforced; one it finds unlikely is pushed down. The term needs no reward, so with no reward
source it is the whole signal (pure distillation); with one it is added to the estimator's
advantage, after the estimator's own normalisation.
"""
from __future__ import annotations

import math

import torch

from core.masked import check_masked, require, zero_pad

Tensor = torch.Tensor


def teacher_kl(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> Tensor:
    """[B, T] the per-token reverse-KL estimate log pi_student - log pi_teacher of the sampled
    tokens (all [B, T]), 0 where ``mask`` is 0. Its mean over the sampled tokens estimates
    KL(student || teacher), since the tokens were drawn from the student."""
    fn = "teacher_kl"
    check_masked(fn, mask, nonempty=False, student_logprobs=student_logprobs, teacher_logprobs=teacher_logprobs)
    return zero_pad(student_logprobs.detach() - teacher_logprobs.detach(), mask)


def distilled_advantages(advantages: Tensor, student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor,
                         coef: float) -> Tensor:
    """[B, T] A_t - coef * (log pi_student - log pi_teacher)_t on the valid tokens, 0 elsewhere.

    advantages: the estimator's [B, T] (zeros for pure distillation); student_logprobs: the
    policy's log-probs of the sampled tokens at the start of the update (PPO's old log-probs);
    teacher_logprobs: the teacher's of the same tokens, under the same temperature and, with
    truncated sampling, renormalised over the same kept sets. coef > 0, finite."""
    fn = "distilled_advantages"
    require(coef > 0 and math.isfinite(coef), f"{fn}: coef must be a finite number > 0, got {coef}")
    check_masked(fn, mask, nonempty=False, advantages=advantages)
    kl = teacher_kl(student_logprobs, teacher_logprobs, mask)
    return zero_pad(advantages - coef * kl, mask)

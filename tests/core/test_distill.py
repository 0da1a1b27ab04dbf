"""On-policy distillation's term: each sampled token's advantage gets -coef x (log pi_student -
log pi_teacher), checked by hand; the teacher's log-probs travel from the scorer through the
buffer's annotation into the learner's batch unchanged."""
import numpy as np
import pytest
import torch

from core.annotate import annotate
from core.distill import distilled_advantages, teacher_kl
from core.rollout import FrozenLogprobs, Rollout
from learner.batch import collate

pytestmark = pytest.mark.unit


def test_the_term_is_the_reverse_kl_estimate_of_each_token_weighted_by_coef():
    adv = torch.tensor([[0.5, 0.5, 0.0], [-1.0, 0.0, 0.0]])
    student = torch.tensor([[-1.0, -2.0, 9.0], [-0.5, 7.0, 7.0]])
    teacher = torch.tensor([[-0.5, -4.0, -9.0], [-0.5, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    out = distilled_advantages(adv, student, teacher, mask, coef=2.0)
    # by hand: row 0: 0.5 - 2*(-1 - -0.5) = 1.5; 0.5 - 2*(-2 - -4) = -3.5; row 1: -1 - 2*0 = -1
    assert out.tolist() == [[1.5, -3.5, 0.0], [-1.0, 0.0, 0.0]]
    assert teacher_kl(student, teacher, mask).tolist() == [[-0.5, 2.0, 0.0], [0.0, 0.0, 0.0]]


def test_pure_distillation_pushes_down_exactly_the_tokens_the_teacher_finds_unlikelier():
    student = torch.log(torch.tensor([[0.5, 0.5]]))
    teacher = torch.log(torch.tensor([[0.9, 0.1]]))
    out = distilled_advantages(torch.zeros(1, 2), student, teacher, torch.ones(1, 2), coef=1.0)
    assert out[0, 0] > 0 > out[0, 1]


@pytest.mark.parametrize("coef", [0.0, -1.0, float("inf"), float("nan")])
def test_a_coefficient_that_is_not_a_positive_number_is_refused(coef):
    with pytest.raises(ValueError, match="coef must be a finite number > 0"):
        distilled_advantages(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), coef)


def _rollout(n: int, index: int) -> Rollout:
    return Rollout(prompt_ids=np.array([1, 2]), response_ids=np.arange(3, 3 + n),
                   behaviour_logprobs=np.full(n, -1.0, np.float32), finish_reason="stop", policy_version=0,
                   prompt_index=index, sample_index=0)


def test_teacher_logprobs_reach_the_learners_batch_row_by_row():
    rollouts = [_rollout(3, 0), _rollout(1, 1), _rollout(0, 2)]  # the empty one is left out
    frozen = FrozenLogprobs.of(FrozenLogprobs([np.zeros(3), np.zeros(1), np.zeros(0)],
                                              [np.array([-0.1, -0.2, -0.3]), np.array([-0.4]), np.zeros(0)]))
    scored = annotate(rollouts, frozen.reference, np.array([1.0, 2.0, 3.0]), beta=0.0,
                      teacher_logprobs=frozen.teacher)
    assert [s.teacher_logprobs.tolist() for s in scored] == [pytest.approx([-0.1, -0.2, -0.3]), [pytest.approx(-0.4)]]
    batch = collate(scored, pad_id=0)
    assert batch.teacher_logprobs.shape == (2, 3) and batch.teacher_logprobs[1].tolist() == pytest.approx([-0.4, 0, 0])
    plain = annotate(rollouts[:2], [np.zeros(3), np.zeros(1)], np.zeros(2), beta=0.0)
    assert collate(plain, 0).teacher_logprobs is None


def test_a_plain_list_is_the_references_alone_and_a_teacher_of_the_wrong_length_is_refused():
    assert FrozenLogprobs.of([np.zeros(2)]).teacher is None
    with pytest.raises(ValueError, match="2 response tokens but 1 teacher log-probs"):
        annotate([_rollout(2, 0)], [np.zeros(2)], np.zeros(1), beta=0.0, teacher_logprobs=[np.zeros(1)])

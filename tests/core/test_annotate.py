import numpy as np
import pytest

from core.annotate import RewardShaping, annotate, annotate_valid
from core.kl import KLPenalty
from core.rollout import Rollout, ScoredRollout

pytestmark = pytest.mark.unit


def _rollout(R, finish="stop", seed=0, version=3, prompt_index=0, sample_index=0):
    rng = np.random.default_rng(seed)
    return Rollout(prompt_ids=rng.integers(0, 100, size=4), response_ids=rng.integers(0, 100, size=R),
                   behaviour_logprobs=-rng.uniform(0.1, 3.0, size=R), finish_reason=finish,
                   policy_version=version, prompt_index=prompt_index, sample_index=sample_index)


def _refs(rollouts, seed=1):
    rng = np.random.default_rng(seed)
    return [r.behaviour_logprobs + rng.normal(0, 0.5, size=r.response_ids.size).astype(np.float32)
            for r in rollouts]


def test_score_lands_on_last_token_only():
    rollouts = [_rollout(5, seed=0), _rollout(2, seed=1, prompt_index=1), _rollout(1, seed=2, prompt_index=2)]
    refs = _refs(rollouts)
    scores = np.array([2.0, -1.5, 0.75], np.float32)
    out = annotate(rollouts, refs, scores, beta=0.1)
    assert [type(s) for s in out] == [ScoredRollout] * 3
    for r, ref, s, sr in zip(rollouts, refs, scores, out):
        kl = r.behaviour_logprobs - ref  # k1
        np.testing.assert_allclose(sr.kl, kl, atol=1e-6)
        expected = -0.1 * kl
        expected[-1] += s
        np.testing.assert_allclose(sr.rewards, expected, atol=1e-6)
        assert sr.score == pytest.approx(float(s))
        assert sr.rewards.shape == sr.kl.shape == sr.reference_logprobs.shape == r.response_ids.shape
        np.testing.assert_array_equal(sr.reference_logprobs, ref)
        for name in ("prompt_ids", "response_ids", "behaviour_logprobs"):
            np.testing.assert_array_equal(getattr(sr, name), getattr(r, name))
        assert (sr.policy_version, sr.prompt_index, sr.finish_reason) == \
            (r.policy_version, r.prompt_index, r.finish_reason)


def test_beta_zero_leaves_only_the_score():
    r = _rollout(6)
    out = annotate([r], _refs([r]), np.array([1.25]), beta=0.0)[0]
    np.testing.assert_array_equal(out.rewards, [0, 0, 0, 0, 0, 1.25])


@pytest.mark.parametrize("placement, kl_in_rewards", [("reward", True), ("loss", False)])
def test_kl_in_the_loss_leaves_the_rewards_to_the_score(placement, kl_in_rewards):
    """With the KL as a loss term the rewards are the scores alone; the KL is still measured."""
    r = _rollout(5, seed=3)
    ref = _refs([r])
    kl = KLPenalty(beta=0.3, estimator="k3" if placement == "loss" else "k1", placement=placement)
    assert kl.in_loss is not kl_in_rewards
    shaping = RewardShaping.for_step(kl)
    (out,), _, _ = annotate_valid([r], ref, np.array([1.5]), np.array([True]), shaping)
    assert (out.kl != 0).all()
    expected = -0.3 * out.kl if kl_in_rewards else np.zeros(5, np.float32)
    expected[-1] += 1.5
    np.testing.assert_allclose(out.rewards, expected, atol=1e-6)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimator_selection(estimator):
    rollouts = [_rollout(4, seed=5), _rollout(7, seed=6)]
    refs = _refs(rollouts, seed=7)
    out = annotate(rollouts, refs, np.zeros(2), beta=0.5, kl_estimator=estimator)
    for r, ref, sr in zip(rollouts, refs, out):
        d = r.behaviour_logprobs.astype(np.float64) - ref  # log pi - log ref
        expected = {"k1": d, "k2": 0.5 * d ** 2, "k3": np.exp(-d) - 1 + d}[estimator]
        np.testing.assert_allclose(sr.kl, expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(sr.rewards, -0.5 * expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="estimator"):
        annotate(rollouts, refs, np.zeros(2), beta=0.5, kl_estimator="k4")


def test_truncation_penalty_only_on_length_rollouts():
    rollouts = [_rollout(3, "stop", seed=1), _rollout(3, "length", seed=1), _rollout(4, "length", seed=2)]
    refs = [r.behaviour_logprobs.copy() for r in rollouts]  # zero KL isolates the terminal reward
    out = annotate(rollouts, refs, np.array([1.0, 1.0, 0.5]), beta=0.1, truncation_penalty=-2.0)
    np.testing.assert_allclose(out[0].rewards, [0, 0, 1.0])
    np.testing.assert_allclose(out[1].rewards, [0, 0, -1.0])
    np.testing.assert_allclose(out[2].rewards, [0, 0, 0, -1.5])
    assert [o.score for o in out] == [1.0, 1.0, 0.5]  # the raw score, before penalty


def test_reward_clip_applies_to_score_not_penalty():
    rollouts = [_rollout(2, "stop"), _rollout(2, "length")]
    refs = [r.behaviour_logprobs.copy() for r in rollouts]
    out = annotate(rollouts, refs, np.array([10.0, -10.0]), beta=0.1, reward_clip=3.0,
                   truncation_penalty=-1.0)
    assert out[0].rewards[-1] == pytest.approx(3.0)
    assert out[1].rewards[-1] == pytest.approx(-4.0)
    assert out[0].score == 10.0


def test_empty_responses_are_skipped_in_order():
    rollouts = [_rollout(3, prompt_index=0), _rollout(0, prompt_index=1), _rollout(2, prompt_index=2),
                _rollout(0, "length", prompt_index=3)]
    refs = _refs(rollouts)
    scores = np.array([1.0, np.nan, 2.0, 5.0])  # a skipped item's score is never read
    out = annotate(rollouts, refs, scores, beta=0.1)
    assert [o.prompt_index for o in out] == [0, 2]
    assert len(rollouts) - len(out) == 2
    assert [o.rewards[-1] + 0.1 * o.kl[-1] for o in out] == pytest.approx([1.0, 2.0])
    assert annotate([_rollout(0)], [np.zeros(0)], np.zeros(1), beta=0.1) == []


def test_bad_inputs():
    r = _rollout(3, prompt_index=7, sample_index=2)
    ref = _refs([r])
    with pytest.raises(ValueError, match="1 rollouts but 2 scores"):
        annotate([r], ref, np.zeros(2), beta=0.1)
    with pytest.raises(ValueError, match="1 rollouts but 0 reference"):
        annotate([r], [], np.zeros(1), beta=0.1)
    with pytest.raises(ValueError, match="prompt_index=7, sample_index=2.*3 response tokens but 2"):
        annotate([r], [np.zeros(2)], np.zeros(1), beta=0.1)
    with pytest.raises(ValueError, match="non-finite score"):
        annotate([r], ref, np.array([np.nan]), beta=0.1)
    with pytest.raises(ValueError, match="non-finite behaviour, reference"):
        annotate([r], [np.array([0.0, -np.inf, 0.0])], np.zeros(1), beta=0.1)
    with pytest.raises(ValueError, match="beta"):
        annotate([r], ref, np.zeros(1), beta=-1.0)


def test_reward_score_is_the_score_as_it_entered_the_rewards():
    """What the group estimators compare: the clipped score plus the truncation penalty, in the
    rewards' float32, so with beta 0 the last token's reward is exactly it and equal raw scores
    give equal reward scores."""
    rollouts = [_rollout(3, seed=0), _rollout(2, finish="length", seed=1, prompt_index=1),
                _rollout(4, seed=2, prompt_index=2), _rollout(2, seed=3, prompt_index=3)]
    out = annotate(rollouts, _refs(rollouts), np.array([3.3, 0.9, 7.0, 3.3]), beta=0.0,
                   truncation_penalty=-0.5, reward_clip=5.0)
    want = np.float32([3.3, 0.9, 5.0, 3.3]) + np.float32([0, -0.5, 0, 0])  # added in float32, as the rewards
    assert [sr.reward_score for sr in out] == [float(w) for w in want]
    assert [float(sr.rewards[-1]) for sr in out] == [float(w) for w in want]
    assert out[0].reward_score == out[3].reward_score and out[0].score == 3.3


def _episode(turn_rewards, finish="stop"):
    """Two policy turns (columns 0-1 and 4-5) around an observation (2-3)."""
    mask = np.array([1, 1, 0, 0, 1, 1], bool)
    return Rollout(prompt_ids=[1, 2], response_ids=[5, 6, 7, 8, 9, 10],
                   behaviour_logprobs=np.where(mask, -1.0, 0.0), finish_reason=finish, policy_version=0,
                   prompt_index=0, sample_index=0, action_mask=mask, turn_rewards=turn_rewards)


@pytest.mark.parametrize("clip, finish, placed, penalty", [
    (None, "stop", [0, 0.5, 0, 0, 0, 2.0], 0.0), (1.0, "stop", [0, 0.5, 0, 0, 0, 1.0], 0.0),
    (None, "length", [0, 0.5, 0, 0, 0, 2.0], -1.0)])
def test_turn_rewards_land_on_each_turns_last_token(clip, finish, placed, penalty):
    turns = _episode([0, 0.5, 0, 0, 0, 2.0], finish)
    terminal = _episode(None, finish)
    refs = [np.where(turns.action_mask, -1.25, 0.0).astype(np.float32)] * 2
    by_turn, by_score = annotate([turns, terminal], refs, np.array([2.5, 2.5]), beta=0.1, reward_clip=clip,
                                 truncation_penalty=-1.0)
    kl = np.where(turns.action_mask, 0.25, 0.0)  # k1: behaviour - reference, none on the observation
    np.testing.assert_allclose(by_turn.rewards, -0.1 * kl + np.array(placed) + [0, 0, 0, 0, 0, penalty], atol=1e-6)
    assert by_turn.score == 2.5 and by_turn.reward_score == pytest.approx(sum(placed) + penalty)
    # the same episode rewarded as a whole: the score (clipped) on its last token only
    whole = min(2.5, clip or 9) + penalty
    np.testing.assert_allclose(by_score.rewards, -0.1 * kl + [0, 0, 0, 0, 0, whole], atol=1e-6)


def test_turn_rewards_must_sit_on_the_policys_tokens():
    with pytest.raises(ValueError, match="0 on the environment's tokens"):
        _episode([0, 0, 1.0, 0, 0, 0])
    with pytest.raises(ValueError, match="6 finite values"):
        _episode([0, 0, 0, 0, np.nan, 1.0])

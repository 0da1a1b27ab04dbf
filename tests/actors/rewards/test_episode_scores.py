"""An episode's score: the environment's rewards summed, or a reward's score of the transcript;
either way an episode its environment failed is invalid, with its reason counted once."""
import numpy as np
import pytest

from actors.rewards.environment_scores import environment_scores, void_invalid_episodes
from actors.rewards.scoring import ScoreResult
from core.rollout import Rollout

pytestmark = pytest.mark.unit


def episode(score, error=None):
    return Rollout(prompt_ids=[1], response_ids=[5, 6, 7], behaviour_logprobs=[-1.0, 0.0, -1.0],
                   finish_reason="stop", policy_version=0, prompt_index=0, sample_index=0,
                   action_mask=np.array([1, 0, 1], dtype=bool), env_score=score, env_error=error)


BROKE = "environment e:Env.step raised RuntimeError: broke"


def test_environment_scores_are_the_episodes_and_invalid_where_the_environment_failed():
    out = environment_scores([episode(1.5), episode(float("nan"), BROKE), episode(float("nan"), BROKE)])
    assert out.valid.tolist() == [True, False, False] and out.scores[0] == 1.5 and np.isnan(out.scores[1])
    assert out.errors == [f"{BROKE} (2 of 3 episodes invalid)"]


def test_a_rewards_score_of_a_failed_episode_is_made_invalid():
    scored = ScoreResult(np.array([0.5, 0.7], np.float32), np.array([True, True]), ["a reward's own line"])
    out = void_invalid_episodes(scored, [episode(0.0), episode(float("nan"), BROKE)])
    assert out.valid.tolist() == [True, False] and out.scores[0] == 0.5 and np.isnan(out.scores[1])
    assert out.errors == ["a reward's own line", f"{BROKE} (1 of 2 episodes invalid)"]
    assert void_invalid_episodes(scored, [episode(0.0), episode(1.0)]) is scored


def test_an_episode_rewarded_by_turn_places_each_reward_on_its_turns_last_token():
    from actors.environments.episodes import Episode
    ep = Episode(0, [1], 0, 0)
    ep.add([5, 6], [-1.0, -1.0], trained=True)
    ep.rewards.append((1, 0.5))
    ep.add([7], None, trained=False)
    ep.add([8], [-1.0], trained=True)
    ep.rewards.append((3, 2.0))
    assert ep.rollout(0, by_turn=True).turn_rewards.tolist() == [0, 0.5, 0, 2.0]
    assert ep.rollout(0).turn_rewards is None and ep.rollout(0).env_score == 2.5

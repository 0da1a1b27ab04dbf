"""The reward replica looks each rollout's columns up by its prompt_index (the dataset id) in the
table it was handed at construction, and passes them to the text scorer (and to the gold one)."""

import numpy as np
import pytest
from reward_configs import reward_config

from actors.reward import Reward
from core.columns import PromptColumns
from core.rollout import Rollout

pytestmark = pytest.mark.integration

TABLE = PromptColumns(ids=[10, 11, 12], rows=[{"answer": 3}, {"answer": 7, "bonus": 1.0}, {"answer": -2}])


def _rollouts(indices):
    return [Rollout(prompt_ids=np.array([5, 6]), response_ids=np.array([7, 8]),
                    behaviour_logprobs=np.zeros(2, np.float32), finish_reason="stop", policy_version=0,
                    prompt_index=i, sample_index=0) for i in indices]


def test_each_rollout_gets_its_own_rows_columns_and_gold_too(policy_path):
    rw = Reward(config=reward_config(function="column_rewards:answer_echo", gold="column_rewards:answer_plus_bonus"),
                tokenizer=policy_path, columns=TABLE)
    assert rw.health()["columns"] == ["answer", "bonus"]
    res = rw.score_rollouts(_rollouts([11, 10, 12, 11]))
    assert res.valid.all() and res.scores.tolist() == [7.0, 3.0, -2.0, 7.0]
    # an optional column a row lacks arrives as None (this function then uses its own default)
    gold = rw.gold_scores(_rollouts([11, 10]))
    assert gold.scores.tolist() == [8.0, 3.0]


def test_rollouts_numbered_by_position_get_no_columns_and_a_function_that_requires_one_fails(policy_path):
    rw = Reward(config=reward_config(function="column_rewards:answer_echo"), tokenizer=policy_path, columns=TABLE)
    res = rw.score_rollouts(_rollouts([0, 1]))
    assert not res.valid.any() and "answer" in res.errors[0]
    plain = Reward(config=reward_config(function="column_rewards:answer_echo"),
                   tokenizer=policy_path)  # no table at all
    assert not plain.score_rollouts(_rollouts([10])).valid.any()


def test_a_reward_model_ignores_the_columns(reward_path):
    rw = Reward(config=reward_config(model=reward_path), columns=TABLE)
    assert rw.score_rollouts(_rollouts([10, 11])).valid.all()

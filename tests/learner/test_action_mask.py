"""A multi-turn transcript's environment tokens (Rollout.action_mask 0) are context, never
trained: through annotate and a real DeepSpeed update, what sits at those tokens (behaviour and
reference log-probs, so their KL and rewards) leaves the weights unchanged to the bit, while
the tokens themselves, as context, change them; and the policy's tokens train as before."""
import dataclasses

import numpy as np
import pytest
import torch
from helpers import make_rollouts, max_abs_diff, sgd_config

from core.annotate import annotate
from core.rollout import Rollout
from learner.worker import LearnerWorker

TURN, OBS = 4, 3  # a transcript: turn | observation | turn


def transcripts(policy_path, *, env_logprob=-3.0, env_ids_seed=0, grouped=False):
    """Four rollouts whose responses are turn (4) | observation (3) | turn (4), annotated with a
    reference 0.1 off the behaviour; ``env_logprob``: the behaviour and reference log-prob
    written at the observation's tokens; ``env_ids_seed``: draws the observation's ids."""
    base = make_rollouts(policy_path, 4, seed=3, response_len=(2 * TURN + OBS, 2 * TURN + OBS))
    rng = np.random.default_rng(env_ids_seed)
    mask = np.r_[np.ones(TURN), np.zeros(OBS), np.ones(TURN)].astype(bool)
    out, refs = [], []
    for i, r in enumerate(base):
        ids = r.response_ids.copy()
        ids[~mask] = rng.integers(2, 1024, OBS)
        behaviour = np.where(mask, r.behaviour_logprobs, env_logprob).astype(np.float32)
        out.append(Rollout(prompt_ids=r.prompt_ids, response_ids=ids, behaviour_logprobs=behaviour,
                           finish_reason="stop", policy_version=0, prompt_index=i // 2 if grouped else i,
                           sample_index=i % 2, action_mask=mask))
        refs.append(np.where(mask, behaviour - 0.1, 2 * env_logprob).astype(np.float32))
    scored = annotate(out, refs, np.array([1.0, -0.5, 0.3, 2.0]), beta=0.1)
    return [dataclasses.replace(s, chunk_id=0) for s in scored]


def update(policy_path, rollouts, advantage):
    torch.manual_seed(0)
    w = LearnerWorker(rank=0, world_size=1, model=policy_path, config=sgd_config(advantage=advantage))
    before = w.full_state_dict()
    metrics = w.train(rollouts)
    after = w.full_state_dict()
    assert max_abs_diff(after, before) > 1e-3, "the update must move the weights measurably"
    return after, metrics


@pytest.mark.integration
@pytest.mark.parametrize("advantage", ["gae", "grpo"])
def test_environment_tokens_carry_no_gradient_and_stay_context(policy_path, advantage):
    grouped = advantage != "gae"
    first = transcripts(policy_path, grouped=grouped)
    assert all(r.kl[TURN:TURN + OBS].sum() == 0 and r.rewards[TURN:TURN + OBS].sum() == 0 for r in first)
    assert all(r.rewards[-1] != 0 for r in first)  # the score on the last token the policy sampled
    weights, metrics = update(policy_path, first, advantage)
    other_logprobs, _ = update(policy_path, transcripts(policy_path, env_logprob=-40.0, grouped=grouped), advantage)
    assert max_abs_diff(other_logprobs, weights) == 0.0
    other_ids, _ = update(policy_path, transcripts(policy_path, env_ids_seed=1, grouped=grouped), advantage)
    assert max_abs_diff(other_ids, weights) > 1e-6  # observations are context for the next turn
    assert metrics["learner/tokens"] == 4 * 2 * TURN


@pytest.mark.unit
def test_an_action_mask_that_does_not_fit_the_response_is_refused():
    kw = dict(prompt_ids=[1, 2], response_ids=[3, 4, 5], behaviour_logprobs=np.zeros(3), finish_reason="stop",
              policy_version=0, prompt_index=0, sample_index=0)
    assert Rollout(**kw, action_mask=[1, 0, 1]).trained_tokens == 2 and Rollout(**kw).trained_tokens == 3
    for bad, says in (([1, 0], "3 values of 0/1"), ([1, 2, 1], "3 values of 0/1"), ([1, 1, 0], "end on a policy")):
        with pytest.raises(ValueError, match=says):
            Rollout(**kw, action_mask=bad)

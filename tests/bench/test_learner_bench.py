"""bench/learner.py's ragged workload: seeded, within its ranges, every response stopped at EOS."""
import numpy as np
import pytest

from bench.learner import RAGGED_PROMPT, RAGGED_RESPONSE, parse_args, rollouts

pytestmark = pytest.mark.unit

WORKLOAD = {"prompt_ids": [list(range(10 + i, 26 + i)) for i in range(20)], "eos_token_id": 2, "vocab_size": 64}


def test_ragged_rollouts_are_seeded_spread_and_stop_at_eos():
    batch = rollouts(WORKLOAD, 200, 16, ragged=True)
    again = rollouts(WORKLOAD, 200, 16, ragged=True)
    assert all(np.array_equal(a.response_ids, b.response_ids) and np.array_equal(a.prompt_ids, b.prompt_ids)
               for a, b in zip(batch, again))
    prompts = np.array([r.prompt_ids.size for r in batch])
    responses = np.array([r.response_ids.size for r in batch])
    assert RAGGED_PROMPT[0] <= prompts.min() and prompts.max() <= RAGGED_PROMPT[1]
    assert RAGGED_RESPONSE[0] <= responses.min() and responses.max() <= RAGGED_RESPONSE[1]
    assert responses.max() - responses.min() > 150 and prompts.max() - prompts.min() > 80  # spread, not clustered
    text = set(np.concatenate(WORKLOAD["prompt_ids"]).tolist())
    for r in batch:
        assert r.finish_reason == "stop" and r.response_ids[-1] == 2 and 2 not in r.response_ids[:-1]
        assert r.response_ids.max() < 64 and set(r.prompt_ids.tolist()) <= text
        assert r.behaviour_logprobs.size == r.response_ids.size == r.reference_logprobs.size == r.rewards.size


def test_fixed_rollouts_are_as_before_and_packed_sides_parse():
    batch = rollouts(WORKLOAD, 4, 16)
    assert all(r.response_ids.size == 16 and r.finish_reason == "length" for r in batch)
    assert parse_args(["--sides", "tether,tether-packed,tether-packed-masked", "--ragged"]).sides == [
        "tether", "tether-packed", "tether-packed-masked"]


def test_the_scorers_bench_counts_what_each_layout_feeds():
    from bench.scorers import fed_tokens

    batch = rollouts(WORKLOAD, 40, 16, ragged=True)
    real = sum(r.prompt_ids.size + r.response_ids.size for r in batch)
    assert fed_tokens(batch, "reference", packing=True) == fed_tokens(batch, "reward", packing=True) == real
    # right-padded whole rows pad less than prompt | response, and both more than nothing
    assert real < fed_tokens(batch, "reward", packing=False) < fed_tokens(batch, "reference", packing=False)
    fixed = rollouts(WORKLOAD, 40, 16)
    assert fed_tokens(fixed, "reference", packing=False) == sum(r.prompt_ids.size + 16 for r in fixed)

"""Unit tests for core/layout.py: padded ids and masks, position ids, last-token pooling."""
import numpy as np
import pytest
import torch

from core.layout import last_token_index, pad_prompt_response, pad_right, pool_last_token, position_ids

pytestmark = pytest.mark.unit

PAD = 9


def a(*xs):
    return np.array(xs, dtype=np.int64)


def test_prompt_response_left_pads_prompts_and_right_pads_responses():
    ids, mask = pad_prompt_response([a(1, 2), a(3, 4, 5)], [a(6, 7, 8), a(0)], PAD)
    assert ids.dtype == mask.dtype == np.int64
    assert ids.tolist() == [[PAD, 1, 2, 6, 7, 8], [3, 4, 5, 0, PAD, PAD]]
    assert mask.tolist() == [[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]


def test_prompt_response_every_response_starts_at_column_p():
    prompts = [a(1), a(1, 2, 3, 4), a(5, 6)]
    responses = [a(7, 7), a(8), a(9, 9, 9)]
    ids, _ = pad_prompt_response(prompts, responses, 0)
    P = 4
    for row, r in enumerate(responses):
        assert ids[row, P:P + r.size].tolist() == r.tolist()


def test_prompt_response_empty_and_one_token_responses():
    ids, mask = pad_prompt_response([a(1, 2), a(3)], [a(), a(4)], PAD)
    assert ids.tolist() == [[1, 2, PAD], [PAD, 3, 4]]
    assert mask.tolist() == [[1, 1, 0], [0, 1, 1]]
    ids, mask = pad_prompt_response([a(1)], [a()], PAD)  # no response column at all
    assert ids.tolist() == [[1]] and mask.tolist() == [[1]]


def test_pad_right_pads_after_each_sequence():
    ids, mask = pad_right([a(1, 2, 3), a(4), a()], PAD)
    assert ids.tolist() == [[1, 2, 3], [4, PAD, PAD], [PAD, PAD, PAD]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0]]
    assert ids.dtype == mask.dtype == np.int64


def test_pad_right_takes_lists_and_int32():
    ids, _ = pad_right([[1, 2], np.array([3], dtype=np.int32)], 0)
    assert ids.tolist() == [[1, 2], [3, 0]] and ids.dtype == np.int64


def test_position_ids_count_real_tokens_only():
    _, mask = pad_prompt_response([a(1, 2), a(3, 4, 5)], [a(6, 7, 8), a(0)], PAD)
    pos = position_ids(torch.from_numpy(mask))
    assert pos.dtype == torch.int64
    # Left padding gets 0 and does not shift the prompt; right padding is never read.
    assert pos.tolist() == [[0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 3, 3]]


def test_position_ids_of_a_bool_or_float_mask_are_int64():
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    assert position_ids(mask).tolist() == [[0, 0, 1]] and position_ids(mask).dtype == torch.int64
    assert position_ids(mask.bool()).tolist() == [[0, 0, 1]]


def test_last_token_index_and_pooling():
    _, mask = pad_right([a(1, 2, 3), a(4), a(5, 6)], PAD)
    mask_t = torch.from_numpy(mask)
    assert last_token_index(mask_t).tolist() == [2, 0, 1]
    hidden = torch.arange(3 * 3 * 2, dtype=torch.float32).reshape(3, 3, 2)
    pooled = pool_last_token(hidden, mask_t)
    assert pooled.shape == (3, 2)
    assert torch.equal(pooled, torch.stack([hidden[0, 2], hidden[1, 0], hidden[2, 1]]))

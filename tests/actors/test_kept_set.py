"""Reading the sampler's kept set from vLLM's flat processed log-probs (actors/kept_set.py)."""
from types import SimpleNamespace

import numpy as np
import pytest

from actors import kept_set

pytestmark = pytest.mark.unit
INF = float("-inf")


def flat(per_position):
    """vLLM's FlatLogprobs layout: per position the sampled token's entry, then the top list."""
    ids, values, start, end = [], [], [], []
    for entries in per_position:
        start.append(len(ids))
        ids += [i for i, _ in entries]
        values += [v for _, v in entries]
        end.append(len(ids))
    return SimpleNamespace(token_ids=ids, logprobs=values, start_indices=start, end_indices=end)


def test_the_read_covers_ties_past_k():
    assert kept_set.logprobs_to_read(20, 1024) == 40
    assert kept_set.logprobs_to_read(2, 1024) == 2 + kept_set.TIE_MARGIN
    assert kept_set.logprobs_to_read(20, 30) == -1  # the margin reaches the vocabulary: read it all
    assert kept_set.logprobs_to_read(0, 1024) == -1  # top_p alone
    assert kept_set.logprob_request(20, 1.0, 1024)["logprobs"] == 40
    assert kept_set.logprob_request(0, 1.0, 1024) == {"logprobs": 0, "flat_logprobs": True, "detokenize": False}


def test_finite_entries_are_the_kept_set_and_a_read_without_a_dropped_token_is_incomplete():
    lp = np.log(0.25)
    # read 4: position 0 keeps 3 tokens (3 tied), the read reached -inf: complete;
    # position 1's four entries are all finite: the set may go on, counted incomplete.
    logprobs = flat([[(7, lp), (7, lp), (3, lp), (9, np.log(0.5)), (1, INF)],
                     [(2, lp), (5, lp), (2, lp), (6, lp), (8, lp)]])
    behaviour, kept, incomplete = kept_set.read_completion([7, 2], logprobs, read=4)
    assert behaviour.tolist() == pytest.approx([lp, lp])
    assert kept.tolist() == [[3, 7, 9, -1], [2, 5, 6, 8]]
    assert incomplete == 1
    assert kept_set.read_completion([7, 2], logprobs, read=-1)[2] == 0  # the whole vocabulary was read


def test_an_untruncated_read_takes_the_sampled_tokens_entries():
    logprobs = flat([[(7, -0.5)], [(2, -1.25)], [(9, -3.0)]])
    assert kept_set.read_sampled([7, 2, 9], logprobs).tolist() == [-0.5, -1.25, -3.0]
    with pytest.raises(ValueError, match="not the 3 sampled tokens"):
        kept_set.read_sampled([7, 4, 9], logprobs)
    with pytest.raises(ValueError, match="for 3 positions that are not the 2 sampled tokens"):
        kept_set.read_sampled([7, 2], logprobs)

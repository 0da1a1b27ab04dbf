"""The rules every text reward shares: what a valid score is, and which columns a function takes."""
import math

import numpy as np
import pytest

from actors.rewards.scoring import ColumnBinding, FunctionScorer, coerce_scores, load_function

pytestmark = pytest.mark.unit


def test_a_list_of_numbers_scores_and_what_is_not_a_number_is_invalid_item_by_item():
    res = coerce_scores([1, 2.5, np.float32(3), None, "4", math.nan, True], 7, "reward function f")
    assert res.valid.tolist() == [True, True, True, False, False, False, True]
    assert res.scores[:3].tolist() == [1.0, 2.5, 3.0] and not res.failed
    assert len(res.errors) == 1 and "NoneType, str instead of a number for 2 of 7 items" in res.errors[0]


@pytest.mark.parametrize("out, needle", [(None, "returned NoneType, not a list"), ("0.5", "returned str"),
                                         ({"a": 1}, "returned dict"), ([1.0], "returned 1 scores for 2 items")])
def test_a_return_that_is_not_one_number_per_pair_invalidates_the_call(out, needle):
    res = coerce_scores(out, 2, "reward function f")
    assert res.failed and not res.valid.any() and needle in res.errors[0]


def test_column_binding_reads_the_signature():
    def two(prompts, responses):
        ...

    def named(prompts, responses, *, answer, source="x"):
        ...

    def positional(prompts, responses, answer):
        ...

    def everything(prompts, responses, **columns):
        ...

    cols = {"answer": [1], "source": ["a"], "id": [7]}
    assert ColumnBinding.of(two).select(cols) == {}
    assert ColumnBinding.of(named).select(cols) == {"answer": [1], "source": ["a"]}
    assert ColumnBinding.of(named).missing(["source"]) == ["answer"]
    assert ColumnBinding.of(positional).select(cols) == {"answer": [1]}
    assert ColumnBinding.of(everything).select(cols) == cols and ColumnBinding.of(everything).missing([]) == []


def test_function_scorer_passes_the_columns_it_takes_and_survives_what_it_raises():
    def exact(prompts, responses, *, answer):
        return [float(r.strip() == str(a)) for r, a in zip(responses, answer)]

    scorer = FunctionScorer(exact, name="reward function exact", timeout_s=30)
    res = scorer.score_texts(["p", "q"], [" 7", "8"], {"answer": [7, 9], "source": ["add", "add"]})
    assert res.scores.tolist() == [1.0, 0.0]
    res = scorer.score_texts(["p"], ["7"], {})  # the column missing: the call raises, the items are invalid
    assert res.failed and "TypeError" in res.errors[0]


@pytest.mark.parametrize("old, new", [("cluster.rewards:math", "actors.rewards:math"),
                                      ("cluster.envs:Calculator", "actors.environments:Calculator")])
def test_a_builtin_by_its_old_name_gets_its_new_name(old, new):
    with pytest.raises(ValueError) as e:
        load_function(old, "reward.function")
    assert str(e.value).endswith(f"the built-ins moved: write {new}") and "\n" not in str(e.value)
    assert callable(load_function(new, "reward.function"))

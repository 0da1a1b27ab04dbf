"""PromptColumns: the prompt rows' other fields by dataset id, as the reward replicas look them up."""
import pickle

import pytest

from core.columns import PromptColumns

pytestmark = pytest.mark.unit


def table():
    return PromptColumns(ids=[7, 3, 5], rows=[{"answer": 4, "source": "gsm8k"}, {"answer": [1, 2]},
                                              {"source": "math", "answer": None}])


def test_take_looks_up_by_dataset_id_in_the_order_asked_and_keeps_json_types():
    t = table()
    assert t.names == ("answer", "source") and len(t) == 3
    assert t.take([3, 7, 7]) == {"answer": [[1, 2], 4, 4], "source": [None, "gsm8k", "gsm8k"]}
    assert isinstance(t.take([7])["answer"][0], int)  # an int answer stays an int: the verifier decides
    assert t.take([]) == {"answer": [], "source": []}


def test_an_index_not_in_the_table_gives_no_columns_at_all():
    """Rollouts numbered by batch position (tests, bench): a function that requires a column then
    fails loudly (a missing keyword argument) instead of scoring on None."""
    assert table().take([7, 0]) == {}
    assert PromptColumns().take([0, 1]) == {} and PromptColumns().names == ()


def test_row_and_membership_and_pickling():
    t = pickle.loads(pickle.dumps(table()))  # what ray.put does
    assert t.row(5) == {"answer": None, "source": "math"} and t.row(99) == {}
    assert 3 in t and 4 not in t
    with pytest.raises(ValueError, match="distinct"):
        PromptColumns(ids=[1, 1], rows=[{}, {}])
    with pytest.raises(ValueError, match="2 ids for 1 rows"):
        PromptColumns(ids=[1, 2], rows=[{}])

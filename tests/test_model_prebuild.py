"""Which test sessions start the background model prebuild (tests/model_prebuild.py)."""
import model_prebuild
import pytest

pytestmark = pytest.mark.unit


class Item:
    """A collected test as far as ``wanted`` looks at it: its markers by name."""

    def __init__(self, *markers: str):
        self.markers = set(markers)

    def get_closest_marker(self, name: str):
        return name if name in self.markers else None


def test_a_session_that_runs_a_service_test_wants_the_models():
    assert model_prebuild.wanted([Item("unit"), Item("integration")])
    assert model_prebuild.wanted([Item("e2e"), Item("gpu", "integration", "skip")])


def test_a_session_of_unit_tests_or_skipped_ones_wants_none():
    assert not model_prebuild.wanted([Item("unit"), Item("unit")])
    assert not model_prebuild.wanted([Item("gpu", "integration", "skip"), Item("unit")])  # gpu tier without CUDA
    assert not model_prebuild.wanted([])

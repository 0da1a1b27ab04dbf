"""A step's rollout accounting: incomplete kept sets summed over chunks, and the console's warning."""
import pytest

from cluster.runtime.observe.produced import Produced, kept_set_warning

pytestmark = pytest.mark.unit


def test_incomplete_kept_sets_sum_over_chunks_and_warn_only_above_zero():
    merged = Produced(incomplete_kept_sets=2).merge(Produced(incomplete_kept_sets=1))
    assert merged.incomplete_kept_sets == 3
    assert kept_set_warning(Produced()) == ""
    line = kept_set_warning(merged)
    assert line.startswith("warning: 3 sampled positions") and "\n" not in line
    assert "rollouts/incomplete_kept_sets" in line and "generator.engine.dtype=float32" in line

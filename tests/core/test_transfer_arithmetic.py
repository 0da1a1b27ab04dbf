"""Transfer arithmetic and Pull (no Ray: values passed directly are never pulled)."""
import dataclasses

import pytest

from core.infra.transfer import Pull, Transfer, pull_args

pytestmark = pytest.mark.unit


def test_transfers_add_field_by_field_and_stay_frozen():
    a, b = Transfer(100, 0.5, 7), Transfer(20, 0.25, 3)
    assert a + b == Transfer(120, 0.75, 10)
    assert Transfer.total([a, b, Transfer()]) == a + b
    assert Transfer.total([]) == Transfer() == Transfer(0, 0.0, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.bytes_cross_node = 1
    with pytest.raises(TypeError):
        a + 1  # noqa: B018 - not a Transfer


def test_as_metrics_and_pop_metrics_round_trip():
    t = Transfer(8_000_253, 0.03, 342)
    metrics = {"ppo/lr": 1e-5, **t.as_metrics("transfer/to_learner")}
    assert metrics["transfer/to_learner_bytes"] == 8_000_253
    assert Transfer.pop_metrics(metrics, "transfer/to_learner") == t
    assert metrics == {"ppo/lr": 1e-5}  # the keys are gone
    assert Transfer.pop_metrics({}, "transfer/to_learner") == Transfer()  # absent: nothing moved


def test_values_passed_directly_are_not_pulled():
    rollouts = [object()]
    values, moved = pull_args(rollouts, 3, None)
    assert values == [rollouts, 3, None] and values[0] is rollouts
    assert moved == Transfer()
    assert Pull("ref").ref == "ref"


def test_lost_with_a_node_sees_a_lost_object_however_ray_wraps_it():
    from ray.exceptions import ObjectReconstructionFailedError, RayTaskError

    from core.infra.transfer import lost_with_a_node

    lost = ObjectReconstructionFailedError(b"\x00" * 28)
    wrapped = RayTaskError("put_chunk", "traceback", lost)  # an actor task whose argument was lost
    assert lost_with_a_node(lost) and lost_with_a_node(wrapped)
    assert not lost_with_a_node(RayTaskError("put_chunk", "traceback", ValueError("bad reward")))
    assert not lost_with_a_node(ValueError("no"))

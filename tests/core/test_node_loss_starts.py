"""A start that dies with its node is tried again off that node; any other failure is not."""
import pytest

from core.infra.node_loss import NODE_ID_LABEL, off_nodes, start_placed

pytestmark = pytest.mark.unit


class Died(Exception):
    def __init__(self, init_failed: bool = False):
        super().__init__("died")
        self.actor_init_failed = init_failed


def starts(outcomes, dead_after):
    """start(avoid) raising or returning per ``outcomes``; the dead nodes after each try."""
    tries, dead = [], [frozenset()]

    def start(avoid):
        tries.append(avoid)
        dead.append(frozenset(dead_after[len(tries) - 1]))
        outcome = outcomes[len(tries) - 1]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    return start, tries, lambda: dead[-1]


def test_a_start_whose_node_died_goes_again_off_that_node():
    start, tries, dead = starts([Died(), "up"], [{"n1"}, {"n1"}])
    assert start_placed(start, errors=(Died,), timeout_s=60, what="buffer", dead=dead) == "up"
    assert tries == [frozenset(), frozenset({"n1"})]


def test_no_node_died_or_its_own_constructor_failed_or_out_of_time_is_raised():
    start, tries, dead = starts([Died()], [set()])
    with pytest.raises(Died):  # the actor died, its node did not: not a placement matter
        start_placed(start, errors=(Died,), timeout_s=60, what="buffer", dead=dead)
    start, tries, dead = starts([Died(init_failed=True)], [{"n1"}])
    with pytest.raises(Died):
        start_placed(start, errors=(Died,), timeout_s=60, what="buffer", dead=dead)
    clock = iter([0.0, 61.0])
    start, tries, dead = starts([Died()], [{"n1"}])
    with pytest.raises(Died):
        start_placed(start, errors=(Died,), timeout_s=60, what="buffer", dead=dead, clock=lambda: next(clock))
    assert len(tries) == 1


def test_off_nodes_is_a_ray_label_selector():
    assert off_nodes({"b" * 56, "a" * 56}) == {NODE_ID_LABEL: f"!in({'a' * 56},{'b' * 56})"}
    assert off_nodes(()) == {}

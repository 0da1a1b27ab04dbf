"""Placing actors in Ray placement groups: the scheduling options of one bundle, and waiting
until a group's bundles sit on live nodes. The learner's ranks and the service's pools
both place this way."""
from __future__ import annotations

import time
from typing import Optional

from core.infra.node_loss import dead_nodes

POLL_S = 0.1


def on_bundle(pg, index: int = 0) -> dict:
    """Actor options that start it in bundle ``index`` of ``pg``; {} for no group (Ray places it)."""
    if pg is None:
        return {}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=index)}


def group_nodes(pg) -> dict[int, str]:
    """bundle index -> the node id it is placed on, for a placement group."""
    from ray.util import placement_group_table
    return _bundle_nodes(placement_group_table(pg))


def _bundle_nodes(table: dict) -> dict[int, str]:
    # Ray leaves the entry out (or None) while no bundle is placed yet
    return dict(table.get("bundles_to_node_id") or {})


def wait_placed(pg, timeout_s: float, avoid: frozenset = frozenset()) -> Optional[str]:
    """None once every bundle of ``pg`` is placed on a live node outside ``avoid`` (Ray places a
    new group, and re-places the bundles of a dead node, by itself); after ``timeout_s`` without
    that, the group's state in lower case ("pending", "rescheduling", ...) for the message."""
    from ray.util import placement_group_table

    deadline = time.monotonic() + timeout_s
    while True:
        table = placement_group_table(pg)
        state, nodes = table["state"], set(_bundle_nodes(table).values())
        if state == "CREATED" and not nodes & (avoid | dead_nodes()):
            return None
        if time.monotonic() > deadline:
            return state.lower()
        time.sleep(POLL_S)

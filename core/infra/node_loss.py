"""Starting an actor while a node may be dying.

Ray counts a lost node alive for a few seconds more (until its health checks fail:
cluster/nodes/health.py) and may place a new actor there meanwhile: a replacement started
right after a death it saw first (a learner rank's, say) can land on the very node that
is dying. That actor never runs; it dies once Ray declares the node dead. Such a start is
tried again, kept off every node seen dying since the first try, until the placement
timeout; any other failure is raised as it is.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Iterable, TypeVar

log = logging.getLogger(__name__)

NODE_ID_LABEL = "ray.io/node-id"  # every Ray node carries its own id as this label

T = TypeVar("T")


def dead_nodes() -> frozenset[str]:
    """The ids of the nodes Ray lists as no longer alive."""
    import ray
    return frozenset(n["NodeID"] for n in ray.nodes() if not n.get("Alive"))


def off_nodes(nodes: Iterable[str]) -> dict:
    """A label selector (Ray's ``label_selector`` syntax) that keeps an actor or a bundle off
    ``nodes``; {} for none."""
    nodes = sorted(nodes)
    return {NODE_ID_LABEL: f"!in({','.join(nodes)})"} if nodes else {}


def start_placed(start: Callable[[frozenset[str]], T], *, errors: tuple, timeout_s: float, what: str,
                 dead: Callable[[], frozenset[str]] = dead_nodes, clock: Callable[[], float] = time.monotonic) -> T:
    """``start(avoid)``, started again while it fails with one of ``errors`` and a node died
    during the try (the started actor went with it); ``avoid``: the nodes seen dying since the
    first try (empty on it). The last failure is raised once no node died during a try, on an
    error of the actor's own constructor, or after ``timeout_s``."""
    deadline, before = clock() + timeout_s, dead()
    avoid: frozenset[str] = frozenset()
    while True:
        seen = dead()
        try:
            return start(avoid)
        except errors as e:
            died = dead() - seen
            if not died or getattr(e, "actor_init_failed", False) or clock() > deadline:
                raise
            avoid = frozenset(avoid | died | (seen - before))
            log.warning("%s: placed on a node that died (%s); starting it again on another node",
                        what, ", ".join(sorted(node[:8] for node in died)))

"""Placement by node: which nodes a pool may use (its ``node_labels``), where a ``spread`` pool's
next replica goes, the one-line error when a pool cannot be placed, and where each actor landed.

A node's labels come from ``ray start --labels`` (every node also carries ``ray.io/node-id``).
A node is named for people by its id's first 8 hex digits and its own labels:
``9d4393fb[tether.pool=gen]``.
"""
from __future__ import annotations

from collections import Counter
from typing import Optional

import ray

from cluster.config.labels import format_labels
from core.infra.node_loss import NODE_ID_LABEL
from core.infra.placement import group_nodes

RAY_PREFIX = "ray.io/"            # Ray's own labels (ray.io/node-id, ...)
LISTED_NODES = 8                  # nodes an error lists by name before "and N more"


class PlacementError(RuntimeError):
    """A pool's resources cannot be reserved on this cluster."""


def alive_nodes() -> list[dict]:
    return [n for n in ray.nodes() if n.get("Alive")]


def matches(node: dict, labels: dict) -> bool:
    """Whether ``node`` (a ray.nodes() entry) carries every label of ``labels``."""
    return labels.items() <= (node.get("Labels") or {}).items()


def carrying(labels: dict) -> list[dict]:
    """The alive nodes carrying every label of ``labels``."""
    return [n for n in alive_nodes() if matches(n, labels)]


def could_hold(node: dict, bundle: dict) -> bool:
    """Whether the node's total resources (not what is free now) are enough for ``bundle``."""
    total = node.get("Resources") or {}
    return all(total.get(k, 0.0) >= v for k, v in bundle.items())


def node_name(node_id: str, labels: Optional[dict] = None) -> str:
    """``9d4393fb[tether.pool=gen]``: the id's first 8 hex digits and the node's own (not ray.io/) labels."""
    own = {k: v for k, v in sorted((labels or {}).items()) if not k.startswith(RAY_PREFIX)}
    return node_id[:8] + (f"[{format_labels(own)}]" if own else "")


def pack_target(held: list[str]) -> Optional[str]:
    """The node a pack pool's next replica should go to: the one holding the most of the pool's
    replicas (``held``), so they fill as few nodes as possible; None for the first (Ray picks)."""
    return Counter(held).most_common(1)[0][0] if held else None


def spread_target(labels: dict, bundle: dict, held: list[str], avoid: frozenset = frozenset()) -> Optional[str]:
    """The node a spread pool's next replica should go to: of the alive nodes carrying ``labels``
    that could hold ``bundle`` (and are not in ``avoid``, nodes seen dying), the one holding the
    fewest of the pool's replicas (``held``: the node id of each); None when there is none (Ray
    then waits for one, up to the timeout)."""
    count = Counter(held)
    nodes = [n["NodeID"] for n in carrying(labels) if could_hold(n, bundle) and n["NodeID"] not in avoid]
    return min(nodes, key=lambda node_id: (count[node_id], node_id), default=None)


def cannot_place(pool: str, replicas: int, bundle: dict, timeout_s: float, labels: Optional[dict] = None) -> str:
    """The one line of a PlacementError: the pool, what it asked for, why, and the fix."""
    head = f"pool {pool}: cannot place {replicas} replica(s) x {bundle}"
    if not labels:
        free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
        return (f"{head} within {timeout_s:.0f}s (cluster has {free} free); "
                f"lower {pool}.replicas or its num_cpus/num_gpus")
    text, nodes = format_labels(labels), alive_nodes()
    matching = [n for n in nodes if matches(n, labels)]
    if not matching:
        that = "that label" if len(labels) == 1 else "all those labels"
        why = f"no alive node carries {that}; nodes: {_names(nodes)}"
        fix = f"fix {pool}.node_labels or start a node with --labels {text}"
    else:
        why = f"no room on {_names(matching)}"
        fix = f"lower {pool}.replicas or its num_cpus/num_gpus, or start another node with --labels {text}"
    return f"{head} on nodes labelled {text} within {timeout_s:.0f}s ({why}); {fix}"


def _names(nodes: list[dict]) -> str:
    names = [node_name(n["NodeID"], n.get("Labels")) for n in nodes]
    more = len(names) - LISTED_NODES
    if not names:
        return "none"
    return ", ".join(names[:LISTED_NODES]) + (f" and {more} more" if more > 0 else "")


# ---------------------------------------------------------------- where each actor landed
def actor_nodes(pools) -> dict[str, dict]:
    """actor name -> {"node_id", "labels"} for every actor of the run (generator-*, reference-*,
    reward-*, learner-*, buffer-*): from its placement group where it has one, else asked."""
    where: dict[str, str] = {}
    asked: dict[str, object] = {}
    for pool in (pools.generators, pools.references, pools.rewards):
        for rid, (handle, pg) in pool.placements().items():
            where[rid] = group_nodes(pg).get(0, "") if pg is not None else ""
            if not where[rid]:
                asked[rid] = handle
    ranks = group_nodes(pools.learner_placement) if pools.learner_placement is not None else {}
    for rank, worker in enumerate(pools.learner.workers):
        where[f"learner-{rank}"] = ranks.get(rank, "")
        if not where[f"learner-{rank}"]:
            asked[f"learner-{rank}"] = worker
    asked[pools.buffer_slot.id] = pools.buffer_slot.handle
    where.update(ask_nodes(asked))
    labels = {n["NodeID"]: n.get("Labels") or {} for n in ray.nodes()}
    return {name: {"node_id": node_id,
                   "labels": {k: v for k, v in labels.get(node_id, {}).items() if k != NODE_ID_LABEL}}
            for name, node_id in where.items()}


def ask_nodes(handles: dict[str, object], timeout_s: float = 30.0) -> dict[str, str]:
    """name -> the node id each actor runs on, asked in the actor itself ("" if it did not answer)."""
    # __ray_call__ is Ray's DeveloperAPI for running a function inside an actor: no method of ours needed.
    refs = {name: h.__ray_call__.remote(_own_node) for name, h in handles.items()}
    out = {}
    for name, ref in refs.items():
        try:
            out[name] = ray.get(ref, timeout=timeout_s)
        except Exception:  # noqa: BLE001 - a dead or stuck actor: where it was is unknown
            out[name] = ""
    return out


def _own_node(actor) -> str:
    return ray.get_runtime_context().get_node_id()


def actors_line(nodes: dict[str, dict]) -> str:
    """``generator-0@9d4393fb[tether.pool=gen], reference-0@...``: the start-up log's actors."""
    return ", ".join(f"{name}@{node_name(n['node_id'], n['labels']) if n['node_id'] else '?'}"
                     for name, n in nodes.items())

"""What crossed between nodes when an actor took its inputs: ``Transfer``, ``Pull`` and ``pull()``.

Ray resolves an ObjectRef passed as a whole argument before the method runs, so the method
cannot tell how many bytes came from another node, nor how long that took. A reference
nested inside an argument is left alone (the callee borrows it): wrapped in a ``Pull``, it
reaches the method unresolved, and the method takes it with ``pull_args``, which asks the
object's owner where each object lives and how large it is, then times the ``ray.get``.

An object in an object store is *cross-node* if no copy of it is on the puller's node when
the pull starts; the seconds are those of the get that fetched it. An object small enough
to travel inline (under Ray's ~100 KB, kept in its owner's memory, not in an object store)
comes inside the call itself, from the node of the process that made the ``Pull`` (the
driver, which owns the objects it passes on): cross-node if that is another node, with no
seconds of its own (they are part of the call). Its trip from the actor that made it back
to its owner, in that call's reply, is not counted. Sizes are Ray's (data + metadata). Two
consumers on one node pulling one object at the same moment each count it, though Ray
moves it once.

Torch-free; Ray is imported only when something is pulled, so values passed directly (tests,
in-process use) cost nothing and need no Ray.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Optional


@dataclass(frozen=True)
class Transfer:
    """Bytes and seconds of object transfer into one consumer (or a sum of them)."""
    bytes_cross_node: int = 0        # objects that were on another node, or came inline from one
    seconds_cross_node: float = 0.0  # wall time of gets that fetched any from another node's store
    bytes_local: int = 0             # objects already on the puller's node, or inline from it

    def __add__(self, other: "Transfer") -> "Transfer":
        if not isinstance(other, Transfer):
            return NotImplemented
        return Transfer(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    @staticmethod
    def total(transfers) -> "Transfer":
        """The sum of ``transfers`` (Transfer() for none)."""
        out = Transfer()
        for t in transfers:
            out = out + t
        return out

    def as_metrics(self, prefix: str) -> dict:
        """``{prefix}_bytes``, ``{prefix}_seconds``, ``{prefix}_local_bytes`` as plain numbers."""
        return {f"{prefix}_bytes": self.bytes_cross_node, f"{prefix}_seconds": self.seconds_cross_node,
                f"{prefix}_local_bytes": self.bytes_local}

    @staticmethod
    def pop_metrics(metrics: dict, prefix: str) -> "Transfer":
        """The Transfer ``as_metrics(prefix)`` wrote into ``metrics``, its keys removed (absent: 0)."""
        return Transfer(int(metrics.pop(f"{prefix}_bytes", 0)), float(metrics.pop(f"{prefix}_seconds", 0.0)),
                        int(metrics.pop(f"{prefix}_local_bytes", 0)))


def this_node() -> Optional[str]:
    """This process's Ray node id (hex), or None when Ray is not initialised here."""
    import ray
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


@dataclass(frozen=True)
class Pull:
    """An ObjectRef the receiving actor method takes itself, with ``pull_args``: Ray leaves a
    reference nested in an argument unresolved, so the method can measure the transfer.
    ``sent_from``: the node of the process that made the Pull (None without Ray)."""
    ref: object
    sent_from: Optional[str] = field(default_factory=this_node)


def pull(refs) -> tuple[list, Transfer]:
    """``ray.get`` of ``refs`` (ObjectRefs, or Pulls) inside an actor or task, and what it moved
    between nodes.

    Every object must exist already (its task finished): a pending one has no size yet and
    counts 0 bytes. A lost object raises as ``ray.get`` does (e.g. ObjectLostError)."""
    import ray
    from ray.experimental import get_object_locations

    pulls = [r if isinstance(r, Pull) else Pull(r) for r in refs]  # a bare ref: sent from here
    if not pulls:
        return [], Transfer()
    here, refs = this_node(), [p.ref for p in pulls]
    where = get_object_locations(refs)  # objects whose lookup failed are left out: the get says why
    stored = inline = local = 0
    for p in pulls:
        loc = where.get(p.ref) or {}
        size, nodes = int(loc.get("object_size") or 0), loc.get("node_ids") or []
        if here in nodes:
            local += size
        elif nodes or loc.get("did_spill"):  # in other nodes' object stores (or spilled: node unknown)
            stored += size
        elif p.sent_from not in (None, here):  # inline: it came inside the call, from the sender's node
            inline += size
        else:
            local += size
    t0 = time.perf_counter()
    values = ray.get(refs)
    return values, Transfer(stored + inline, time.perf_counter() - t0 if stored else 0.0, local)


def pull_args(*args) -> tuple[list, Transfer]:
    """``args`` with every ``Pull`` replaced by its pulled value (one ``pull`` for them all);
    other values stay as they are and count nothing."""
    wanted = [a for a in args if isinstance(a, Pull)]
    if not wanted:
        return list(args), Transfer()
    values, moved = pull(wanted)
    it = iter(values)
    return [next(it) if isinstance(a, Pull) else a for a in args], moved


def lost_with_a_node(error: BaseException) -> bool:
    """Whether a call failed because an object it took was lost (the node holding it died):
    the producer generates such a chunk again, the learner rolls back."""
    from ray.exceptions import ObjectLostError, RayTaskError

    cause = error.cause if isinstance(error, RayTaskError) and error.cause is not None else error
    return isinstance(cause, ObjectLostError)

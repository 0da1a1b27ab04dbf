"""What a pool's stand-in shows where a Pool lists its actors: one "replica" that is no actor of
the pool's own (learner rank 0 scoring the reference, Ray tasks reading episodes' scores), so
nothing to list, place or ask about. Subclasses give ``first`` (its handle) and ``REPLICA``."""
from __future__ import annotations


class StandIn:
    """The views of a Pool for a stand-in of one replica called ``replica_id``."""

    replica_id = ""

    def first(self):
        raise NotImplementedError

    def handle(self, replica_id: str):
        return self.first() if replica_id == self.replica_id else None

    def handles(self) -> dict:
        """Empty: no actor of its own to list, ask its dtype or place."""
        return {}

    def placements(self) -> dict:
        return {}

    def replica_nodes(self) -> dict:
        return {}

    def shutdown(self) -> None:
        """Nothing of its own to stop."""

"""Runtime scaling: the pool sizes asked for through the job's RunControl actor
(cluster/runtime/pools/control.py, ``python -m cluster.scale``), applied by the driver between steps."""
from __future__ import annotations

import logging
from typing import Callable

import ray

from cluster.runtime.pools.pool import PlacementError

log = logging.getLogger("tether")


def apply_requested(control, pools, *, on_new_generator: Callable[[str], None]) -> None:
    """Resize each pool ``control`` (a RunControl actor, or None) has a request for, and report
    the live sizes back. ``on_new_generator(replica_id)`` runs before a started generator serves
    (the driver gives it the current weights). A request that cannot be placed is reported, not raised."""
    if control is None:
        return
    targets, errors = ray.get(control.pending.remote()), {}
    by_role = pools.by_role()
    for role, n in targets.items():
        try:
            started, retiring = by_role[role].resize(n)
        except PlacementError as e:
            errors[role] = str(e)
            log.warning("scale: %s", e)
            continue
        if role == "generator":
            for rid in started:
                on_new_generator(rid)
        log.info("scale: %s pool now %d (started %s, retiring %s)", role, len(by_role[role]),
                 ", ".join(started) or "none", ", ".join(retiring) or "none")
    if targets:
        ray.get(control.report.remote(pools.sizes(), errors))

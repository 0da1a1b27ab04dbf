"""RunControl: a running job's control point, a small named Ray actor beside the driver.

`python -m cluster.scale` (or any Ray client) asks it for new pool sizes; the driver
reads the request at each step boundary, applies it, and reports the live sizes back.
It holds only numbers: the pools and their actors stay the driver's.
"""
from __future__ import annotations

import os

from cluster.config.ppo import SCALABLE_POOLS

NAMESPACE = "tether"


def actor_name(run_name: str) -> str:
    return f"tether-control-{run_name}"


class RunControl:
    def __init__(self, *, run_dir: str, sizes: dict) -> None:
        self.run_dir = run_dir
        self._sizes = dict(sizes)       # live replicas per pool, as the driver last reported
        self._targets: dict = {}        # requested and not yet applied
        self._errors: dict = {}         # pool -> why the last request could not be applied

    def request(self, targets: dict) -> dict:
        """Ask for ``{pool: replicas}``; returns the sizes now. Raises ValueError on a bad request."""
        for pool, n in targets.items():
            if pool not in SCALABLE_POOLS:
                raise ValueError(f"unknown pool {pool!r}; scale one of {', '.join(SCALABLE_POOLS)}")
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{pool}={n!r}: a pool needs an integer number of replicas >= 1")
        self._targets.update(targets)
        for pool in targets:
            self._errors.pop(pool, None)
        return dict(self._sizes)

    def pending(self) -> dict:
        """The driver's side: requested sizes not applied yet (cleared by report())."""
        return dict(self._targets)

    def report(self, sizes: dict, errors: dict | None = None) -> None:
        """The driver's side: the live sizes after applying, and the requests it could not
        apply (pool -> one line); both kinds of request are cleared."""
        self._sizes, self._errors = dict(sizes), {**self._errors, **(errors or {})}
        self._targets = {p: n for p, n in self._targets.items() if sizes.get(p) != n and p not in self._errors}

    def sizes(self) -> tuple[dict, dict]:
        """(live sizes, errors of requests that could not be applied)."""
        return dict(self._sizes), dict(self._errors)

    def health(self) -> dict:
        return {"role": "control", "ok": True, "pid": os.getpid(), "run_dir": self.run_dir,
                "sizes": dict(self._sizes), "pending": dict(self._targets)}

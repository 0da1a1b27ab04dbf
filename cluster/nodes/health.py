"""How fast Ray notices a lost node, which bounds how fast a run recovers from one.

Ray's GCS health-checks every raylet; a node is declared dead after
``health_check_failure_threshold`` missed checks, each ``health_check_period_ms`` apart.
Until then an actor on a dead node looks alive: calls to it just wait. Ray's defaults
(3 s x 5) take ~15 s to notice; tether's (1 s x 3, with a 1 s timeout) take ~3 s. A node cut
off the network rather than dead answers no check at all, so each one waits out its timeout:
~6 s with tether's settings (measured 5.6 s), 50-65 s with Ray's (a 10 s timeout).

The cost: the GCS sends one small RPC per node per second instead of one per three, and a
raylet that cannot answer for 3 s (a swapping or badly overloaded machine) is declared
dead and its actors are replaced, which a run survives but pays for in a recovery.
A lost head ends every job on it: its processes exit ~10 s later, and a resubmitted run
(``run.resume=auto``) continues from its last checkpoint.

These apply to a cluster's head node only, at its start: the try-out cluster (``tether
cluster up``) and the test fixtures use them; on your own cluster pass them to
``ray start --head --system-config``.
"""
from __future__ import annotations

import json

NODE_FAILURE_DETECTION = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
    # A process that loses the head (the GCS) gives up after this long instead of 60 s: without
    # GCS fault tolerance a head does not come back, so the job ends and can be resubmitted.
    "gcs_rpc_server_reconnect_timeout_s": 10,
}


def system_config_flag(extra: dict | None = None) -> str:
    """The ``ray start --head`` option that applies NODE_FAILURE_DETECTION (and ``extra`` on top)."""
    config = {**NODE_FAILURE_DETECTION, **(extra or {})}
    return f"--system-config={json.dumps(config, separators=(',', ':'))}"

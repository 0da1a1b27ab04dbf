"""Ray calls whose outcome nobody waits for any more."""
from __future__ import annotations


def drain(refs: list, timeout_s: float = 2.0, fetch_local: bool = True) -> list:
    """Fetch the outcome of those of ``refs`` that finish within ``timeout_s``, errors
    included, so Ray does not log their (expected) errors as unhandled; -> the refs still
    running."""
    import ray
    if not refs:
        return []
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s, fetch_local=fetch_local)
    for ref in ready:
        try:
            ray.get(ref)
        except Exception:  # noqa: BLE001 - the caller has raised or logged the error that matters
            pass
    return pending

"""Resize a running job's pools: python -m cluster.scale <run folder> generator=3 reward=2

Finds the job's control actor through the run folder's status.json, asks for the new
sizes and waits until the driver has applied them (at its next step boundary). New
generators get the current weights before their first prompt; removed replicas finish
the chunks they hold first. Exit 0 when applied, 2 on a mistake, 1 if not applied in time.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from cluster.job.errors import EXIT_DONE, EXIT_FAILED, UserError, report, report_error
from core.infra.errors import one_line


class ScaleError(UserError):
    """A mistake in the request: one line, exit 2."""


def parse_targets(items: list[str]) -> dict:
    from cluster.config.ppo import SCALABLE_POOLS

    targets = {}
    for item in items:
        pool, sep, value = item.partition("=")
        if not sep or pool not in SCALABLE_POOLS:
            raise ScaleError(f"{item!r}: expected pool=replicas with pool one of {', '.join(SCALABLE_POOLS)}")
        try:
            n = int(value)
        except ValueError:
            raise ScaleError(f"{item!r}: replicas must be an integer >= 1") from None
        if n < 1:
            raise ScaleError(f"{item!r}: a pool needs at least 1 replica (to stop a job: ray job stop)")
        targets[pool] = n
    if not targets:
        raise ScaleError("nothing to change; pass e.g. generator=3 reward=2")
    return targets


def find_control(run_dir: Path):
    import ray

    status_file = run_dir / "status.json"
    if not status_file.is_file():
        raise ScaleError(f"{run_dir} is not a run folder (no status.json); pass the folder of a running job")
    try:
        status = json.loads(status_file.read_text())
    except ValueError:
        raise ScaleError(f"{status_file} is not valid JSON; pass the folder of a running job") from None
    control = status.get("control")
    if status.get("state") != "running" or not control:
        raise ScaleError(f"the run in {run_dir} is {status.get('state')}, not running; only a running job scales")
    if not ray.is_initialized():
        ray.init(address=control["address"], logging_level=logging.ERROR)
    try:
        return ray.get_actor(control["actor"], namespace=control["namespace"])
    except ValueError:
        raise ScaleError(f"the run in {run_dir} has no live control actor (its driver is gone); "
                         "resume it with run.resume first") from None


def scale(run_dir: Path, targets: dict, timeout_s: float = 600.0) -> dict:
    import ray

    control = find_control(run_dir)
    before = ray.get(control.request.remote(targets))
    asked = ", ".join(f"{p}={n}" for p, n in targets.items())
    print(f"tether: asked {', '.join(f'{p} {before.get(p)} -> {n}' for p, n in targets.items())}; "
          "waiting for the next step boundary", flush=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sizes, errors = ray.get(control.sizes.remote())
        failed = {p: e for p, e in errors.items() if p in targets}
        if failed:
            raise RuntimeError(f"{asked} not applied: {'; '.join(failed.values())}")
        if all(sizes.get(p) == n for p, n in targets.items()):
            return sizes
        time.sleep(0.5)
    raise TimeoutError(f"the driver did not apply the new sizes within {timeout_s:.0f}s")


def main(argv=None, *, prog: str = "python -m cluster.scale") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("run", help="the running job's run folder (run.dir/run.name)")
    ap.add_argument("targets", nargs="*", help="pool=replicas, pool one of generator, reference, reward")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the change")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        sizes = scale(Path(args.run), parse_targets(args.targets), args.timeout)
    except UserError as e:
        return report_error(e)
    except Exception as e:  # noqa: BLE001 - a Ray or timeout failure, in one line
        return report(f"scale failed: {one_line(e)}", EXIT_FAILED)
    print(f"tether: pools now {', '.join(f'{p}={n}' for p, n in sizes.items())}")
    return EXIT_DONE


if __name__ == "__main__":
    sys.exit(main())

"""Job entrypoint: python -m cluster.train [--config configs/X.yaml] [section.key=value ...]

Joins the Ray cluster it runs in (under `ray job submit`, or RAY_ADDRESS /
resources.address), else starts a local one. Exit 0 on success; on a user
mistake, one line on stderr and exit 2; on a failed run, one line and exit 1.
The run folder's status.json says which; only a "succeeded" folder is a result.
"""
from __future__ import annotations

import sys

from cluster.job.command import job_main


def _config_cls():
    from cluster.config.ppo import TetherConfig
    return TetherConfig


def _run(args) -> str:
    from cluster.config.ppo import DEFAULT_CONFIG, load_config
    from cluster.runtime import service
    from cluster.runtime.state.resume import resume_config_file

    cfg = load_config(args.config or resume_config_file(args.overrides) or DEFAULT_CONFIG, args.overrides)
    final = service.run(cfg, overrides=args.overrides)
    return f"reward/mean={final.get('reward/mean', float('nan')):.3f}"


def main(argv=None, *, prog: str = "python -m cluster.train") -> int:
    return job_main(argv, prog=prog, description=__doc__.split("\n")[0],
                    config_cls=_config_cls, run=_run)


if __name__ == "__main__":
    sys.exit(main())

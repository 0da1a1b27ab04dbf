"""Job entrypoint: python -m cluster.train [--config configs/X.yaml] [section.key=value ...]

Joins the Ray cluster it runs in (under `ray job submit`, or RAY_ADDRESS /
resources.address), else starts a local one. Exit 0 on success; on a user
mistake, one line on stderr and exit 2; on a failed run, one line and exit 1.
The run folder's status.json says which; only a "succeeded" folder is a result.
"""
from __future__ import annotations

import logging
import sys

from cluster.job.command import dependency_error, missing_dependencies, parse_args
from cluster.job.errors import Stopped, UserError, one_line


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(sys.argv[1:] if argv is None else argv)  # --help needs no dependencies
    missing = missing_dependencies()
    if missing:  # e.g. `ray job submit` to a Ray started outside the venv: one line, not a traceback
        print(dependency_error(missing), file=sys.stderr)
        return 2
    from cluster.config.ppo import DEFAULT_CONFIG, ConfigError, describe, load_config
    from cluster.runtime import service
    from cluster.runtime.reward_check import InvalidScores

    if args.help_config:
        print(describe())
        return 0
    from cluster.runtime.resume import resume_config_file

    try:
        cfg = load_config(args.config or resume_config_file(args.overrides) or DEFAULT_CONFIG, args.overrides)
        final = service.run(cfg, overrides=args.overrides)
    except (ConfigError, UserError, InvalidScores, FileNotFoundError) as e:
        print(f"tether: error: {one_line(e)}", file=sys.stderr)
        return 2
    except Stopped as e:
        print(f"tether: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("tether: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - a failed run ends in one line, details in the log
        print(f"tether: run failed: {one_line(e)} (traceback in the run folder's error.log)",
              file=sys.stderr)
        return 1
    print(f"tether: done; reward/mean={final.get('reward/mean', float('nan')):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

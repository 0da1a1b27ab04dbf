"""A job's command line, whether this Python can run the job at all, and ``job_main``: the
life of every entrypoint from its arguments to its exit code."""
from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from typing import Callable

from cluster.job.errors import EXIT_DONE, report_error, user_error

# What the job needs importable in the Python that runs it: import name -> pip name.
REQUIRED_MODULES = {"torch": "torch", "ray": "ray", "vllm": "vllm", "transformers": "transformers",
                    "deepspeed": "deepspeed", "yaml": "pyyaml"}


def missing_dependencies() -> list[str]:
    """The REQUIRED_MODULES this interpreter cannot import, as pip names; found without importing."""
    missing = []
    for module, package in REQUIRED_MODULES.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a broken install counts as missing
            found = False
        if not found:
            missing.append(package)
    return missing


def dependency_error(missing: list[str]) -> str:
    return (f"this Python ({sys.executable}) lacks {', '.join(missing)}; run the job "
            "with the project's environment on every node (start `ray` from .venv: see docs/guide/clusters.md, "
            '"On a Ray cluster"), or give the job a container image or runtime_env that has them')


def parse_args(argv, *, prog: str, description: str):
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--config", default=None, help="YAML config (default: the embedded one)")
    ap.add_argument("--help-config", action="store_true", help="print every config key and exit")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. ppo.kl.beta=0.02")
    return ap.parse_args(argv)


def job_main(argv, *, prog: str, description: str, config_cls: Callable[[], type],
             run: Callable[[argparse.Namespace], str]) -> int:
    """Parse ``argv`` (sys.argv's when None), check the dependencies, answer --help-config
    (the keys of ``config_cls()``), then ``run(args)``: load the config and run the job, returning
    the summary after ``tether: done;``. Both callables run after the dependency check, so they
    may import the stack. Every failure ends in one line on stderr and its exit code
    (cluster.job.errors.exit_status: 2 for a user mistake, 1 for any other error)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(sys.argv[1:] if argv is None else argv, prog=prog, description=description)
    missing = missing_dependencies()  # --help above needs none
    if missing:  # e.g. `ray job submit` to a Ray started outside the venv: one line, not a traceback
        return user_error(dependency_error(missing))
    from cluster.config.ppo import describe

    if args.help_config:
        print(describe(config_cls()))
        return EXIT_DONE
    try:
        summary = run(args)
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - every end is one line and its code
        return report_error(e)
    print(f"tether: done; {summary}")
    return EXIT_DONE

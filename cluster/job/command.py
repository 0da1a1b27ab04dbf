"""A job's command line, and whether this Python can run the job at all."""
from __future__ import annotations

import argparse
import importlib.util
import sys

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
    return (f"tether: error: this Python ({sys.executable}) lacks {', '.join(missing)}; run the job "
            "with the project's environment on every node (start `ray` from .venv: see README "
            '"On a Ray cluster"), or give the job a container image or runtime_env that has them')


def parse_args(argv, prog: str = "python -m cluster.train", description: str = __doc__.split("\n")[0]):
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--config", default=None, help="YAML config (default: the embedded one)")
    ap.add_argument("--help-config", action="store_true", help="print every config key and exit")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. ppo.kl.beta=0.02")
    return ap.parse_args(argv)

#!/usr/bin/env bash
# Install (idempotent), lint, and run the default test suite: unit + integration + e2e; gpu tests skip without CUDA.
# Extra arguments go to pytest, e.g. scripts/test.sh -m unit
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
# The linter first (rules in pyproject.toml): a finding fails the run like a failed test.
.venv/bin/python -m ruff check --quiet .
# pytest exits 5 when it collected nothing; set -e turns that (like any failure) into a failed run.
exec .venv/bin/python -m pytest -m "not slow" --durations=30 "$@"

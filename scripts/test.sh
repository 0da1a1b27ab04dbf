#!/usr/bin/env bash
# Install (idempotent), lint, and run the default test suite: unit + integration + e2e; gpu tests skip without CUDA.
# Extra arguments go to pytest, e.g. scripts/test.sh -m unit
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
# The linter first (rules in pyproject.toml): a finding fails the run like a failed test.
.venv/bin/python -m ruff check --quiet .
# Per-test times as JUnit XML, and the 15 slowest files printed at the end (scripts/slowest_files.py).
# pytest exits 5 when it collected nothing: that (like any failure) is the script's exit code.
mkdir -p .test-results
rc=0
.venv/bin/python -m pytest -m "not slow" --durations=30 --junitxml=.test-results/junit.xml "$@" || rc=$?
.venv/bin/python scripts/slowest_files.py .test-results/junit.xml 15 || true
exit "$rc"

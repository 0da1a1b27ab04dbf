#!/usr/bin/env bash
# Install (idempotent) and run the default test suite: unit + integration + e2e; gpu tests skip without CUDA.
# Extra arguments go to pytest, e.g. scripts/test.sh -m unit
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
# pytest exits 5 when it collected nothing; set -e turns that (like any failure) into a failed run.
exec .venv/bin/python -m pytest -m "not slow" --durations=10 "$@"

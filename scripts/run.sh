#!/usr/bin/env bash
# Install (idempotent) and run the PPO job; with no arguments it runs the embedded default configs/tiny-cpu.yaml.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
exec .venv/bin/python -m cluster.train "$@"

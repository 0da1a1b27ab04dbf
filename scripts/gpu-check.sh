#!/usr/bin/env bash
# The GPU path in one command, on a machine with an NVIDIA GPU: install (scripts/setup.sh's GPU
# branch), run the gpu-marked tests, run a 20-step job (configs/gpu-check.yaml: weight_sync=ipc on
# one GPU, nccl and a GPU each with two or more), print its learner MFU, generation tokens/s and
# weight-sync seconds (bench/mfu.py). The job and the report run even when a test failed.
# Exit codes: 0 all passed; 3 no NVIDIA GPU on this machine; 6 every gpu test skipped (the GPU
# stack is not usable: the run checked nothing); otherwise the failing step's.
# Usage: scripts/gpu-check.sh [pytest arguments for the gpu tests]
set -euo pipefail
cd "$(dirname "$0")/.."

gpus=$( { nvidia-smi -L 2>/dev/null || true; } | grep -c '^GPU ' || true)
if [ "${gpus:-0}" -lt 1 ]; then
  echo "gpu-check: no NVIDIA GPU on this machine (nvidia-smi lists none); run this on a machine with at least one" >&2
  exit 3
fi
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0)
echo "gpu-check: $gpus x $gpu_name" >&2

bash scripts/setup.sh
export DS_ACCELERATOR=cuda  # the learner's DeepSpeed on CUDA (scripts/run.sh and test.sh default to cpu)

tests=0
.venv/bin/python -m pytest -m gpu -rs -p no:cacheprovider --require-passed "$@" || tests=$?
[ "$tests" != 6 ] || echo "gpu-check: every gpu test skipped (exit 6 at the end); the skip reasons are above" >&2

if [ "$gpus" -ge 2 ]; then
  placement=(learner.weight_sync=nccl learner.num_gpus=1 generator.num_gpus=1)
else
  placement=(learner.weight_sync=ipc learner.num_gpus=0.5 generator.num_gpus=0.5)
fi
name=gpu-check-$(date +%Y%m%d-%H%M%S)
.venv/bin/python -m cluster.train --config configs/gpu-check.yaml run.dir=runs "run.name=$name" "${placement[@]}"
.venv/bin/python -m bench.mfu "runs/$name" --gpu "$gpu_name" --gpus "$gpus"
exit "$tests"

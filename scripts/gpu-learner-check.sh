#!/usr/bin/env bash
# The learner alone on one NVIDIA GPU, for a machine that lacks the rest of the stack: no Ray, no
# vLLM, no network (scripts/gpu-check.sh needs all three). Runs the update's GPU test
# (tests/learner/test_gpu_update.py: one CUDA update equals the plain-torch one), then bench.learner (tether's DeepSpeed
# PPO update against a plain-torch loop, one process) at bf16 and fp32 on a ~0.49B Qwen2-shaped
# policy (bench/sizes.py `large`), ZeRO-2 and ZeRO-3, shared then separate critic, with the matmul
# peak measured in each run and the MFU against it; then the bf16-vs-fp32 log-prob gap of the same
# policy (bench/logprob_gap.py).
#
# Python: $PYTHON, else .venv/bin/python, else python3 (a GPU image's own torch/transformers).
# Wheels in .whl/ (DeepSpeed and what it needs that the image lacks) are installed into
# $WHEEL_SITE (default /tmp/tether-site) when that python has no deepspeed.
# Time: the runs after the first three are skipped once they would end past BUDGET_S seconds
# (default 340) since the start, so the whole check fits a short lease.
# Output: each run's JSON under $OUT when set, else runs/gpu-learner-check-<time>/; a summary last.
# Exit codes: 0 every run passed; 3 no NVIDIA GPU; 6 the GPU test skipped (torch sees no CUDA: nothing
# checked); else the first failed run's (the rest still run).
# Usage: scripts/gpu-learner-check.sh            # on the GPU machine
#        scripts/gpu-learner-check.sh --cpu-smoke  # the same steps, tiny and on the CPU (a dry run)
set -uo pipefail
cd "$(dirname "$0")/.."

smoke=0
[ "${1:-}" = "--cpu-smoke" ] && smoke=1
if [ -n "${PYTHON:-}" ]; then py=$PYTHON; elif [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
out=${OUT:-runs/gpu-learner-check-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
budget=${BUDGET_S:-340}
log=$(mktemp)  # every run's output, for the summary
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

if [ "$smoke" = 1 ]; then
  device=cpu size=bench
  sizes=(--rollouts 4 --new-tokens 4 --epochs 1 --minibatches 1 --repeats 1)
  gap_sizes=(--rollouts 2 --new-tokens 4)
else
  if [ "$( { nvidia-smi -L 2>/dev/null || true; } | grep -c '^GPU ')" -lt 1 ]; then
    echo "gpu-learner-check: no NVIDIA GPU on this machine (nvidia-smi lists none)" >&2
    exit 3
  fi
  device=cuda size=large
  sizes=(--repeats 2)  # the workload's batch: 64 rollouts x 128 new tokens, 4 epochs of 4 minibatches
  gap_sizes=()
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
fi

has_deepspeed() { "$py" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('deepspeed') is None)"; }
if ! has_deepspeed && compgen -G ".whl/*.whl" >/dev/null; then
  site=${WHEEL_SITE:-/tmp/tether-site}
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    || { echo "gpu-learner-check: installing .whl/ into $site failed" >&2; exit 1; }
  export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
[ "$device" = cuda ] && export DS_ACCELERATOR=cuda || export DS_ACCELERATOR=cpu
"$py" - <<'EOF' || exit 1
import sys, torch, transformers, deepspeed
print(f"gpu-learner-check: python {sys.version.split()[0]} ({sys.executable}), torch {torch.__version__} "
      f"(CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else '-'}), "
      f"transformers {transformers.__version__}, deepspeed {deepspeed.__version__}")
EOF

status=0
# run NAME SECONDS ARGS...: one python step, bounded by SECONDS; its output to the console and the log.
run() {
  local name=$1 limit=$2 rc; shift 2
  echo "gpu-learner-check: == $name (at ${SECONDS}s)" | tee -a "$log"
  timeout --kill-after=10 "$limit" "$py" "$@" 2>&1 | grep -v -E "Loading weights|Writing model shards" | tee -a "$log"
  rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || { echo "gpu-learner-check: $name failed (exit $rc)" | tee -a "$log"; [ "$status" = 0 ] && status=$rc; }
}
# maybe NAME SECONDS ARGS...: run, if it can end within the budget.
maybe() {
  if [ $((SECONDS + $2)) -le "$budget" ]; then run "$@"
  else echo "gpu-learner-check: == $1 skipped: ${SECONDS}s gone, it needs ~$2s, budget ${budget}s"; fi
}
if [ "$device" = cuda ]; then  # the update on CUDA equals the plain-torch one on the CPU (ZeRO-2 and -3)
  run gpu-update-test 150 -m pytest -p no:cacheprovider -m gpu -q -rs --require-passed tests/learner/test_gpu_update.py
fi
bench=(-m bench.learner --device "$device" --policy-size "$size" "${sizes[@]}")
run bf16-shared 150 "${bench[@]}" --dtype bfloat16 --critic shared --zero 2 3 --out "$out/learner-bf16-shared.json"
run fp32-shared 170 "${bench[@]}" --dtype float32 --critic shared --zero 2 3 --out "$out/learner-fp32-shared.json"
run logprob-gap 90 -m bench.logprob_gap --device "$device" --policy-size "$size" "${gap_sizes[@]}" \
  --out "$out/logprob-gap.json"
maybe bf16-separate 90 "${bench[@]}" --dtype bfloat16 --critic separate --zero 2 --out "$out/learner-bf16-separate.json"
maybe fp32-separate 120 "${bench[@]}" --dtype float32 --critic separate --zero 2 --out "$out/learner-fp32-separate.json"

echo "gpu-learner-check: summary ($device, policy size $size, ${SECONDS}s, JSON in $out)"
grep -E "== |failed|trainable parameters|per update|plain torch =|MFU|logprob gap:" "$log"
rm -f "$log"
exit "$status"

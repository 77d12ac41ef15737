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

echo "== gds backend: device tensors <-> NVMe files through kvikio (cuFile), and its fallback"
# kvikio wheels are carried in (no network): put kvikio_cu12-*.whl, libkvikio_cu12-*.whl
# and their nvidia-* / cuda-* dependency wheels in $KVIKIO_WHEELS (default tools/wheels).
# Without them the kvikio tests skip with the reason and the host-staged path still runs.
WHEELS=${KVIKIO_WHEELS:-tools/wheels}
"$VENV/bin/pip" install -q --no-deps --no-build-isolation -e backends/lmcache-backend-disk \
  -e backends/lmcache-backend-gds 2>/dev/null || \
  export PYTHONPATH="$PWD/backends/lmcache-backend-disk/src:$PWD/backends/lmcache-backend-gds/src${PYTHONPATH:+:$PYTHONPATH}"
if ! "$VENV/bin/python" -c "import kvikio" 2>/dev/null && ls "$WHEELS"/*kvikio*.whl >/dev/null 2>&1; then
  "$VENV/bin/pip" install -q --no-index --find-links "$WHEELS" kvikio-cu12 || \
    "$VENV/bin/pip" install -q --no-index --find-links "$WHEELS" kvikio-cu13 || \
    echo "(kvikio wheels in $WHEELS did not install: the kvikio tests will skip)"
fi
"$VENV/bin/python" - <<'PYEOF'
from lmcache_backend_gds.runtime import probe
print("gds I/O path here:", probe(None).text())
PYEOF
if "$VENV/bin/python" -c "import pytest" 2>/dev/null; then
  run_tests backends/lmcache-backend-gds/tests/test_gds_cuda.py -rs
  # the cpu backend's pinned-memory contract tests (pinned host buffers need CUDA)
  run_tests tests/test_contract_builtin.py tests/test_cpu_backend.py -k "Pinned or pinned" -rs
else
  echo "(no pytest here: the gds CUDA tests and the pinned cpu contract tests did NOT run)"
fi
"$VENV/bin/python" benchmarks/gds_gpu_throughput.py --total-mib 1024

echo "gpu_check: all sections passed in $(( $(date +%s) - START )) s"

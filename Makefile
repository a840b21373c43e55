# shardsafe: `make demo` runs the main job, `make test` the full suite.
# Both create .venv and install everything themselves.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch from pip's configured index; plain PyPI gives the CUDA build on Linux. For the CPU
# build: make venv TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=

.PHONY: demo test test-frameworks lint bench clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q '$(TORCH_SPEC)' $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

# framework integrations (torchtitan), apart from `make test`: only what their tests import,
# without torchtitan's own dependency pins (they would move fsspec and huggingface_hub)
test-frameworks: $(STAMP)
	$(BIN)/pip install -q --no-deps 'torchtitan==0.3.0' 'torchdata==0.11.0' 'spmd_types==0.2.3'
	$(BIN)/pip install -q 'tyro>=0.9'
	$(BIN)/python -m pytest -q tests/test_torchtitan.py

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_save_load.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .hypothesis

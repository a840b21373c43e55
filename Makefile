# shardsafe: `make demo` runs the main job, `make test` the full suite.
# Both create .venv and install what they need themselves: the demo only torch and shardsafe
# (numpy, xxhash, tqdm), the tests every dev extra too. One .venv, one stamp per level, so
# `make test` after `make demo` still installs the dev extras.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
CORE_STAMP := $(VENV)/.installed-core
STAMP := $(VENV)/.installed
# torch from pip's configured index; plain PyPI gives the CUDA build on Linux. For the CPU
# build: make venv TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=

.PHONY: demo test lint bench clean venv

venv: $(STAMP)

$(CORE_STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q '$(TORCH_SPEC)' $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(BIN)/pip install -q -e .
	touch $(CORE_STAMP)

$(STAMP): $(CORE_STAMP)
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(CORE_STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_save_load.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .hypothesis

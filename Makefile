# shardsafe: `make demo` runs the main job, `make test` the full suite.
# Both create .venv and install what they need themselves: the demo only torch and shardsafe
# (numpy, xxhash, tqdm), the tests every dev extra too. One .venv, one stamp per level, so
# `make test` after `make demo` still installs the dev extras. `make test` also builds
# .venv312 for the megatron-core 0.19 tests (below).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
CORE_STAMP := $(VENV)/.installed-core
STAMP := $(VENV)/.installed
# torch from pip's configured index; plain PyPI gives the CUDA build on Linux. For the CPU
# build: make venv TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=

.PHONY: demo test test-megatron019 test-frameworks lint bench soak clean venv venv312

# megatron-core 0.17+ needs Python >= 3.12, the main venv's dev extra pins 0.16.1: the tests
# against megatron-core 0.19 run in a second venv made from the first working Python 3.12 found
# (python3.12 on PATH, then pyenv's versions); PY312=/path/to/python3.12 chooses another.
ifeq ($(origin PY312),undefined)
PY312 := $(shell for p in python3.12 $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12*/bin/python3.12 \
	/usr/local/bin/python3.12 /usr/bin/python3.12; do "$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' \
	>/dev/null 2>&1 && { echo "$$p"; break; }; done)
endif
VENV312 := .venv312
STAMP312 := $(VENV312)/.installed
MEGATRON019_SPEC ?= megatron-core==0.19.2
MEGATRON019_TESTS := tests/test_megatron_019.py tests/test_megatron_async.py

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

venv312: $(STAMP312)

$(STAMP312): pyproject.toml Makefile
	@test -n "$(PY312)" || { echo "no Python 3.12 found: set PY312=/path/to/python3.12"; exit 1; }
	$(PY312) -m venv $(VENV312)
	$(VENV312)/bin/pip install -q --upgrade pip
	$(VENV312)/bin/pip install -q '$(TORCH_SPEC)' $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(VENV312)/bin/pip install -q -e . pytest pytest-timeout psutil '$(MEGATRON019_SPEC)'
	touch $(STAMP312)

demo: $(CORE_STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/python -m pytest -q tests -m "not frameworks"
	$(MAKE) test-megatron019

# Only the megatron-core 0.19 file(s): the rest of the suite ran in the main venv.
test-megatron019:
ifeq ($(PY312),)
	@echo "SKIPPED $(MEGATRON019_TESTS): no Python 3.12 here (looked for python3.12 on PATH and in pyenv's versions); set PY312=/path/to/python3.12 to run them"
else
	$(MAKE) $(STAMP312)
	$(VENV312)/bin/python -m pytest -q $(MEGATRON019_TESTS)
endif

# framework integrations apart from `make test`: torchtitan (only what its tests import, without
# its own dependency pins: they would move fsspec and huggingface_hub) and every Lightning test,
# the FSDP1/FSDP2 ones (marked `frameworks`) that `make test` leaves out included
test-frameworks: $(STAMP)
	$(BIN)/pip install -q --no-deps 'torchtitan==0.3.0' 'torchdata==0.11.0' 'spmd_types==0.2.3'
	$(BIN)/pip install -q 'tyro>=0.9'
	$(BIN)/python -m pytest -q tests/test_torchtitan.py tests/test_lightning.py

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_save_load.py

# recovery soak: cycles of train -> one random fault -> restart in a random layout (README
# "Recovery soak"); a failed cycle prints its seed, `benchmarks/soak.py --replay SEED` reruns it;
# every 10th cycle runs each host in its own namespaces (needs root, else said and skipped)
soak: $(STAMP)
	$(BIN)/python benchmarks/soak.py --cycles 500 --namespaces-every 10

clean:
	rm -rf $(VENV) $(VENV312) build dist src/*.egg-info .pytest_cache .hypothesis

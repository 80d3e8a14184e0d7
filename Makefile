# make demo  - set up .venv and run the whole pipeline on a small corpus (CPU, minutes)
# make test  - set up .venv, lint (ruff) and run the test suite (what CI runs)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The torch dev and CI run: its CPU wheel (no CUDA build downloaded). pyproject.toml declares the supported range;
# benchmarks/torch_range.sh tests its ends. `make setup TORCH=2.14.1` sets up another.
TORCH ?= 2.13.0

# The suite runs in parallel worker processes (pytest-xdist): one per core, at most 4 (each loads its own torch).
# PYTEST_JOBS=0 runs it in this one process. Measured on 2 cores: the whole suite 917 s serial, 668 s with 2 workers.
PYTEST_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))

.PHONY: setup lint test test-fast demo bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==$(TORCH) -e '.[test,report,export,serve,parquet]'
	touch $(STAMP)

setup: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check nanoforge tests benchmarks

test: lint
	$(BIN)/python -m pytest -q -n $(PYTEST_JOBS) $(PYTEST_ARGS)

test-fast: lint
	$(BIN)/python -m pytest -q -n $(PYTEST_JOBS) -m "not slow" $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/nanoforge demo

bench: $(STAMP)
	$(BIN)/python benchmarks/throughput.py

clean:
	rm -rf $(VENV) build *.egg-info

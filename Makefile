# make demo  - set up .venv and run the whole pipeline on a small corpus (CPU, minutes)
# make test  - set up .venv, lint (ruff) and run the test suite (what CI runs)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The torch dev and CI run: its CPU wheel (no CUDA build downloaded). pyproject.toml declares the supported range;
# benchmarks/torch_range.sh tests its ends. `make setup TORCH=2.14.1` sets up another.
TORCH ?= 2.13.0

.PHONY: setup lint test test-fast demo bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==$(TORCH) -e '.[test,report,export,serve,parquet]'
	touch $(STAMP)

setup: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check nanoforge tests benchmarks

test: lint
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-fast: lint
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/nanoforge demo

bench: $(STAMP)
	$(BIN)/python benchmarks/throughput.py

clean:
	rm -rf $(VENV) build *.egg-info

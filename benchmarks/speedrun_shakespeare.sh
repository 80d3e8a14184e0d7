#!/usr/bin/env bash
# CPU speedrun: TinyShakespeare validation bits per byte within a wall-time budget (tokenizer + prepare + pretrain).
# Usage: benchmarks/speedrun_shakespeare.sh [--runs 3] [--budget 300] [--steps N] [--threads N] [--work DIR]
# Everything is done by benchmarks/speedrun_shakespeare.py through the ordinary `nanoforge` commands.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
exec "$PY" benchmarks/speedrun_shakespeare.py "$@"

#!/usr/bin/env bash
# Served throughput: `nanoforge serve RUN` against vLLM's CPU build (and optionally `transformers serve
# --continuous-batching`) on the same model (RUN's HF export), the same requests (benchmarks/serve_load.py) and one
# thread each, fp32, one server after the other.
#
#   benchmarks/serve_vs_vllm.sh RUN EXPORT VLLM_VENV [HF_VENV] [--clients "1 8 32"] [--requests "16 32 64"]
#
# RUN is a nanoforge run, EXPORT its `nanoforge export RUN --format hf --out EXPORT`; VLLM_VENV a venv of its own
# with vLLM's CPU build (docs/perf.md says how), HF_VENV one with transformers[serving]. Results: one line per
# server and client count, plus JSON files in $OUT (default /tmp/serve_vs_vllm). Requests are unseeded and run to
# their max_tokens (ignore_eos): vLLM 0.32's CPU build crashes on seeded requests under load.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=$1 EXPORT=$2 VLLM=$3 HF=
shift 3
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then HF=$1; shift; fi
CLIENTS="1 8 32" REQUESTS="16 32 64"
while [ $# -gt 0 ]; do
  case $1 in
    --clients) CLIENTS=$2; shift 2 ;;
    --requests) REQUESTS=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-/tmp/serve_vs_vllm}
PORT=${PORT:-8400}
mkdir -p "$OUT"
grep -m1 "model name" /proc/cpuinfo
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

start() {  # start NAME COMMAND...: the server in its own process group, waiting for /health
  local name=$1; shift
  setsid "$@" > "$OUT/$name.log" 2>&1 < /dev/null &
  echo $! > "$OUT/$name.pid"
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null 2>&1 && return 0
    kill -0 "$(cat "$OUT/$name.pid")" 2>/dev/null || { echo "$name died: $OUT/$name.log" >&2; return 1; }
    sleep 0.5
  done
  echo "$name did not start" >&2; return 1
}

stop() {
  kill -TERM -- "-$(cat "$OUT/$1.pid")" 2>/dev/null || true
  for _ in $(seq 60); do kill -0 "$(cat "$OUT/$1.pid")" 2>/dev/null || return 0; sleep 0.5; done
  kill -KILL -- "-$(cat "$OUT/$1.pid")" 2>/dev/null || true
}

load() {  # load NAME CLIENTS REQUESTS
  .venv/bin/python benchmarks/serve_load.py --url "http://127.0.0.1:$PORT/v1" --clients "$2" --requests "$3" \
    --ignore-eos --no-seed --label "$1" --json "$OUT/$1-c$2.json" < /dev/null | grep -E "label|requests|completion|TTFT|latency"
  ps -o nlwp= -p "$(cat "$OUT/$1.pid")" | xargs echo "threads of the server process:"
}

servers() {  # the servers to compare, one "NAME COMMAND..." per line
  echo "nanoforge .venv/bin/nanoforge serve $RUN --port $PORT --precision fp32 --log-level warning"
  echo "vllm env VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=nobind $VLLM/bin/python -m" \
       "vllm.entrypoints.openai.api_server --model $EXPORT --served-model-name bench --dtype float32" \
       "--max-model-len 2048 --enforce-eager --port $PORT"
  [ -n "$HF" ] && echo "transformers env HF_HUB_OFFLINE=1 $HF/bin/transformers serve $EXPORT --host 127.0.0.1" \
       "--port $PORT --device cpu --dtype float32 --continuous-batching"
  return 0
}

set -- $REQUESTS
for clients in $CLIENTS; do
  requests=$1; shift || true
  while read -r name command; do
    # shellcheck disable=SC2086
    start "$name" $command
    load "$name" "$clients" "$requests"
    stop "$name"
  done < <(servers)
done

#!/usr/bin/env bash
# The GPU check: tokens/s, MFU and peak memory of the mini and base presets in bf16, eager and
# --compile, measured by `nanoforge bench` (the real training loop), and the projected time of one epoch of
# MiniMind-sized data (about 1.2 GB of pretraining text and 1.6 GB of SFT data) from the measured throughput.
# Sized to finish in under 5 minutes on one H200. First it runs benchmarks/gpu_checks.py (SDPA kernels with GQA,
# fused AdamW's found_inf) and benchmarks/gpu_paths.py (every CUDA-only path of the loop and of decoding, for real).
#
#   benchmarks/gpu.sh                     # on the GPU machine; record the output in docs/perf.md
#   benchmarks/gpu.sh --smoke             # (or SMOKE=1) CPU, tiny preset, a few steps: seconds; CI runs it
#
# Knobs (environment): PYTHON (default .venv/bin/python, else python3), OUT (JSON results directory),
# MINI_BATCH / BASE_BATCH (micro-batch; default 64 x 512 and 32 x 1024), STEPS, WARMUP, DEVICE (default cuda).
set -euo pipefail
cd "$(dirname "$0")/.."

SMOKE="${SMOKE:-0}"
[[ "${1:-}" == "--smoke" ]] && SMOKE=1
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
OUT="${OUT:-$(mktemp -d -t nanoforge-gpu-XXXXXX)}"
mkdir -p "$OUT"

if [[ "$SMOKE" == "1" ]]; then
    # preset:batch:seq_len; the smoke run is the same script path on the CPU with the smallest model
    RUNS=("tiny:4:64")
    COMPILES=(false)
    STEPS="${STEPS:-2}" WARMUP="${WARMUP:-1}" DEVICE=cpu
else
    RUNS=("mini:${MINI_BATCH:-64}:512" "base:${BASE_BATCH:-32}:1024")
    COMPILES=(false true)
    STEPS="${STEPS:-20}" WARMUP="${WARMUP:-5}" DEVICE="${DEVICE:-cuda}"
fi

if [[ "$SMOKE" != "1" ]]; then
    echo "== CUDA path checks (benchmarks/gpu_checks.py)" >&2
    "$PYTHON" benchmarks/gpu_checks.py || echo "gpu_checks: a check failed (see above); continuing" >&2
    echo "== CUDA training and inference paths (benchmarks/gpu_paths.py)" >&2
    "$PYTHON" benchmarks/gpu_paths.py --device "$DEVICE" || echo "gpu_paths: a path failed (see above); continuing" >&2
fi

for run in "${RUNS[@]}"; do
    IFS=: read -r preset batch seq <<<"$run"
    for compile in "${COMPILES[@]}"; do
        name="${preset}-bf16-$([[ $compile == true ]] && echo compile || echo eager)"
        echo "== $name: $batch x $seq, $WARMUP warm-up + $STEPS timed steps" >&2
        "$PYTHON" -m nanoforge bench --preset "$preset" --precision bf16 --batch-size "$batch" --seq-len "$seq" \
            --compile "$compile" --device "$DEVICE" --steps "$STEPS" --warmup "$WARMUP" --quiet \
            --json "$OUT/$name.json" >"$OUT/$name.txt"
    done
done

# One table, and the projection: tokens = bytes / 2.79 UTF-8 bytes per token (the 6,400-token BPE on Chinese
# text, docs/perf.md), time = tokens / the best measured tokens/s of the preset (SFT windows are packed, so
# their tokens train at the pretraining rate).
"$PYTHON" - "$OUT" "$SMOKE" <<'EOF'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
results = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}
print("| run | micro-batch | tokens/s | MFU | peak memory | step | data / fwd+bwd / optim ms |")
print("|---|---|---:|---:|---:|---:|---|")
best = {}
for name, r in results.items():
    o, t = r["ours"], r["config"]["train"]
    mfu = f"{100 * o['mfu']:.1f}%" if o.get("mfu") else "-"
    split = " / ".join(f"{o[k]:.1f}" if k in o else "-" for k in ("data_ms", "fwd_bwd_ms", "optim_ms"))
    print(f"| {name} | {t['batch_size']} x {t['seq_len']} | {o['tokens_per_s']:,.0f} | {mfu} | "
          f"{o['peak_memory_gb']:.2f} GB | {o['step_ms']:.1f} ms | {split} |")
    preset = name.split("-")[0]
    best[preset] = max(best.get(preset, 0.0), o["tokens_per_s"])
any_run = next(iter(results.values()))["ours"]
print(f"\ndevice: {any_run['device']}; MFU peak: {any_run['peak_source']}")
BYTES_PER_TOKEN = 2.79
pre_tokens, sft_tokens = 1.2e9 / BYTES_PER_TOKEN, 1.6e9 / BYTES_PER_TOKEN
for preset, tps in best.items():
    pre_s, sft_s = pre_tokens / tps, sft_tokens / tps
    print(f"projected one epoch, {preset} at {tps:,.0f} tokens/s: pretrain 1.2 GB ({pre_tokens / 1e6:,.0f}M tokens) "
          f"{pre_s / 60:.1f} min + SFT 1.6 GB ({sft_tokens / 1e6:,.0f}M tokens) {sft_s / 60:.1f} min = "
          f"{(pre_s + sft_s) / 60:.1f} min")
if sys.argv[2] != "1":  # the targets on one H200
    for preset, target in (("mini", 0.20), ("base", 0.35)):
        mfus = [r["ours"]["mfu"] or 0 for n, r in results.items() if n.startswith(preset + "-")]
        if mfus:
            print(f"target: {preset} bf16 MFU >= {target:.0%}: best {max(mfus):.1%} -> "
                  f"{'met' if max(mfus) >= target else 'NOT met'}")
    if "mini" in best:
        minutes = (pre_tokens + sft_tokens) / best["mini"] / 60
        print(f"target: mini pretrain + SFT epoch < 15 min: {minutes:.1f} min -> {'met' if minutes < 15 else 'NOT met'}")
print(f"\nJSON and tables: {out}")
EOF

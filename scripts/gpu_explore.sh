#!/usr/bin/env bash
# One-off device call (session 9): FP8 chunk sort tilings (one launch vs two, side rows
# apart, words, steps).
set -uo pipefail
OUT=${OUT:-/tmp/qmoe_gpu_out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 QMOE_GPU_CHECK=1; unset TRITON_INTERPRET
timeout 400 python3 benchmarks/sweep_sort_chunks.py --fp8 --steps 1,4 --configs dsv3,qwen3next,gptoss,qwen3,mixtral --out "$OUT/sweep_fp8.json" > "$OUT/sweep_fp8.log" 2>&1; grep "% of copy\|Error" "$OUT/sweep_fp8.log"
timeout 60 python3 -m pytest tests/ops/test_sort_chunks.py -q -p no:cacheprovider -rfE --tb=short 2>&1 | tail -3

#!/usr/bin/env bash
# One-off device call (session 9): side tiles in the rows' layout (qwen3next FP8 sort), and
# the FP8 / opcheck / interop sort tests on the GPU.
set -uo pipefail
OUT=${OUT:-/tmp/qmoe_gpu_out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 QMOE_GPU_CHECK=1; unset TRITON_INTERPRET
timeout 90 python3 benchmarks/sweep_sort_chunks.py --fp8 --steps 4 --configs qwen3next,dsv3 --out "$OUT/sweep_fp8.json" > "$OUT/sweep_fp8.log" 2>&1; grep "% of copy\|Error" "$OUT/sweep_fp8.log"
timeout 230 python3 -m pytest tests/ops/test_fp8.py tests/ops/test_opcheck.py tests/interop tests/ops/test_sort_chunks.py -m "not compile" -q -p no:cacheprovider -rfE --tb=short -k "sort and not reference and not short_rows" 2>&1 | tee "$OUT/tests.log" | tail -15

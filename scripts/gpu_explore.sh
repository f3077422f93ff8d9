#!/usr/bin/env bash
# One-off device call (session 9): the FP8 chunk sort with the new defaults (words, steps
# rule, loads first) as the op, and its GPU tests.
set -uo pipefail
OUT=${OUT:-/tmp/qmoe_gpu_out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 QMOE_GPU_CHECK=1; unset TRITON_INTERPRET
timeout 150 python3 benchmarks/bench_permute.py --configs dsv3,qwen3,qwen3next,mixtral,gptoss,small --ops "sort_chunks" --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1; grep ' ms \|Error' "$OUT/bench.log"
timeout 200 python3 -m pytest tests/ops/test_sort_chunks.py tests/ops/test_fp8.py tests/ops/test_opcheck.py tests/interop -m "not compile" -q -p no:cacheprovider -rfE --tb=short -k "sort" 2>&1 | tee "$OUT/tests.log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -20

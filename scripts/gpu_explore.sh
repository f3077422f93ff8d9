#!/usr/bin/env bash
# One-off device call (session 8): the one-launch chunk sort as the op's CUDA path.
set -uo pipefail
OUT=${OUT:-/tmp/qmoe_gpu_out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 QMOE_GPU_CHECK=1; unset TRITON_INTERPRET
python3 -m pytest tests tests/ops/test_compile_fp8.py -q -p no:cacheprovider -rfE --tb=short -k "sort or compile_fp8" 2>&1 | tee "$OUT/tests.log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -20
python3 benchmarks/bench_permute.py --configs dsv3,qwen3,qwen3next,mixtral,gptoss,small --ops "sort_chunks" --out "$OUT/bench_sort.json" > "$OUT/bench_sort.log" 2>&1; grep ' ms ' "$OUT/bench_sort.log"

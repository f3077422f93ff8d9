#!/usr/bin/env bash
# One-off device call (session 8, last): short-row chunk sorts and the merge backward tiles.
set -uo pipefail
OUT=${OUT:-/tmp/qmoe_gpu_out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1; unset TRITON_INTERPRET
timeout 45 python3 benchmarks/bench_permute.py --configs qwen3next,qwen3,gptoss --ops "fp8 mxfp8: sort_chunks,fp8 blockwise128: sort_chunks,unpermute backward" --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1; grep ' ms \|Error' "$OUT/bench.log"
timeout 25 python3 -m pytest tests/ops/test_sort_chunks.py tests/ops/test_kernels.py -q -p no:cacheprovider -x -k "short_rows or merge_backward_one_pass and 4100" 2>&1 | tail -3

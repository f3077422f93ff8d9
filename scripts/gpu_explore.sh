#!/usr/bin/env bash
# One-off device call of this session's exploration (removed when its figures are in docs).
set -uo pipefail
OUT=${OUT:-/tmp/qmoe_gpu_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
export QMOE_GPU_CHECK=1
timeout 110 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/ops/test_sort_chunks.py \
  tests/ops/test_opcheck.py tests/ops/test_autograd.py tests/ops/test_compile_fp8.py \
  -k "sort or compile" 2>&1 | tee "$OUT/tests.log" | grep -E "^(FAILED|ERROR)|passed|failed|[0-9]+%\]" | tail -12
timeout 45 python3 benchmarks/bench_permute.py --configs dsv3,qwen3,qwen3next,mixtral,gptoss \
  --ops "sort_chunks" --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
grep ' ms ' "$OUT/bench.log" | grep -v "torch:"

#!/usr/bin/env bash
# One-off device call of this session's exploration (removed when its figures are in docs).
set -uo pipefail
OUT=${OUT:-/tmp/qmoe_gpu_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
export QMOE_GPU_CHECK=1
timeout 280 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
  tests/ops/test_quantize_permute.py tests/ops/test_cuda_graph.py tests/ops/test_fp8.py \
  tests/ops/test_autograd.py 2>&1 | tee "$OUT/tests.log" | grep -E "^(FAILED|ERROR)|passed|failed|[0-9]+%\]" | tail -12

#!/usr/bin/env bash
# One-off device call of this session's exploration (removed when its figures are in docs).
set -uo pipefail
OUT=${OUT:-/tmp/qmoe_gpu_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
export QMOE_GPU_CHECK=1
timeout 270 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
  tests/ops/test_kernels.py::test_permute_kernels_refuse_nan_in_routed_probs \
  tests/ops/test_permute_mask.py tests/ops/test_quantize_permute.py tests/ops/test_fp8.py \
  2>&1 | tee "$OUT/tests.log" | grep -E "^(FAILED|ERROR)|passed|failed|[0-9]+%\]" | tail -12
timeout 200 python3 benchmarks/bench_permute.py --configs dsv3,qwen3,qwen3next,mixtral,gptoss \
  --ops "permute(mask),permute_with_probs,fused blockwise128: quantize+permute" \
  --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
grep ' ms ' "$OUT/bench.log" | grep -v "torch:"

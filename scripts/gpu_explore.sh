#!/usr/bin/env bash
# One-off device call (session 8): the one-pass merge backward (sweep, op, tests) and the
# chunk sort as the op's CUDA path (bench).
set -uo pipefail
OUT=${OUT:-/tmp/qmoe_gpu_out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 QMOE_GPU_CHECK=1; unset TRITON_INTERPRET
python3 benchmarks/sweep_merge_backward.py --out "$OUT/sweep_mbwd.json" > "$OUT/sweep_mbwd.log" 2>&1; grep "% of copy\|Error" "$OUT/sweep_mbwd.log"
python3 benchmarks/bench_permute.py --configs dsv3,qwen3,qwen3next,mixtral,gptoss,small --ops "sort_chunks,unpermute backward" --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1; grep ' ms \|Error' "$OUT/bench.log"
python3 -m pytest tests/ops/test_kernels.py tests/ops/test_autograd.py tests/ops/test_opcheck.py -q -p no:cacheprovider -rfE --tb=short -k "merge_backward or autograd or unpermute_bwd or sort" 2>&1 | tee "$OUT/tests.log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -20

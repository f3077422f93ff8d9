#!/usr/bin/env bash
# One-off device call (session 9): FP8 chunk sort in one launch and the short-row words path,
# the merge backward op with merge_backward_tile; GPU tests of those paths.
set -uo pipefail
OUT=${OUT:-/tmp/qmoe_gpu_out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 QMOE_GPU_CHECK=1; unset TRITON_INTERPRET
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
timeout 200 python3 benchmarks/bench_permute.py --configs dsv3,qwen3,qwen3next,mixtral,gptoss,small --ops "sort_chunks,unpermute backward" --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1; grep ' ms \|Error' "$OUT/bench.log"
timeout 120 python3 benchmarks/sweep_sort_chunks.py --scales --configs qwen3next,qwen3,gptoss,dsv3 --out "$OUT/sweep_scales.json" > "$OUT/sweep_scales.log" 2>&1; grep "% of copy\|Error" "$OUT/sweep_scales.log" | tail -40
timeout 230 python3 -m pytest tests/ops/test_sort_chunks.py tests/ops/test_fp8.py tests/ops/test_opcheck.py tests/ops/test_kernels.py -m "not compile" -q -p no:cacheprovider -rfE --tb=short -k "sort or merge_backward" 2>&1 | tee "$OUT/tests.log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -20

#!/usr/bin/env bash
# One-off device calls (session 10); step picked by $1. Outputs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/qmoe_gpu_out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 QMOE_GPU_CHECK=1; unset TRITON_INTERPRET
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
case "${1:-1}" in
1)
  timeout 200 python3 benchmarks/bench_permute.py --configs dsv3,qwen3,qwen3next,mixtral,gptoss,small --ops sort_chunks --out "$OUT/bench_sort.json" > "$OUT/bench_sort.log" 2>&1; grep " ms \|Error" "$OUT/bench_sort.log" | tail -60
  timeout 110 python3 benchmarks/sweep_sort_chunks.py --fp8 --steps 1 --configs qwen3,mixtral,gptoss --out "$OUT/sweep_wide.json" > "$OUT/sweep_wide.log" 2>&1; grep "% of copy\|Error" "$OUT/sweep_wide.log"
  timeout 90 python3 benchmarks/sweep_sort_chunks.py --fp8 --steps 4 --configs qwen3next,dsv3 --out "$OUT/sweep_words.json" > "$OUT/sweep_words.log" 2>&1; grep "% of copy\|Error" "$OUT/sweep_words.log"
  timeout 120 python3 benchmarks/profile_small.py --cprofile 40 --out "$OUT/small.json" > "$OUT/small.log" 2>&1; tail -80 "$OUT/small.log"
  ;;
esac

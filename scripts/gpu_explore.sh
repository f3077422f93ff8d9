#!/usr/bin/env bash
# One-off device call (session 8): the one-launch chunk sort on the GPU (sweep, op tests).
set -uo pipefail
OUT=${OUT:-/tmp/qmoe_gpu_out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1; unset TRITON_INTERPRET
python3 benchmarks/sweep_sort_chunks.py --block-h 1024,2048,4096,8192 --steps 1,4 --warps 4,8 --out "$OUT/sweep_sort.json" 2>&1 | tee "$OUT/sweep_sort.log" | grep -v inverse
python3 benchmarks/sweep_sort_chunks.py --configs dsv3,qwen3next,gptoss --block-h 2048,8192 --steps 4 --warps 8 --random-sizes --out "$OUT/sweep_sort_rand.json" > "$OUT/sweep_sort_rand.log" 2>&1; cat "$OUT/sweep_sort_rand.log"
python3 -m pytest tests/ops -q -p no:cacheprovider -rfE --tb=short -k "sort" 2>&1 | tee "$OUT/tests.log" | tail -15
python3 benchmarks/bench_permute.py --configs dsv3,qwen3,qwen3next,mixtral,gptoss,small --ops "sort_chunks" --out "$OUT/bench_sort.json" > "$OUT/bench_sort.log" 2>&1; grep ' ms ' "$OUT/bench_sort.log"

#!/usr/bin/env bash
# One-off device call (session 8): the one-launch chunk sort on the GPU, and the small eager profile.
set -uo pipefail
OUT=${OUT:-/tmp/qmoe_gpu_out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1; unset TRITON_INTERPRET
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
python3 -m pytest tests/ops/test_sort_chunks.py -q -p no:cacheprovider -rfE --tb=short 2>&1 | tee "$OUT/tests.log" | tail -15
python3 benchmarks/bench_permute.py --configs dsv3,qwen3,qwen3next,mixtral,gptoss,small --ops "sort_chunks" --out "$OUT/bench_sort.json" > "$OUT/bench_sort.log" 2>&1; grep ' ms ' "$OUT/bench_sort.log"
python3 benchmarks/profile_small.py --cprofile 40 --out "$OUT/profile_small.json" > "$OUT/profile_small.log" 2>&1; head -c 9000 "$OUT/profile_small.log"

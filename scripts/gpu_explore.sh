#!/usr/bin/env bash
# One-off device call of this session's exploration (removed when its figures are in docs).
set -uo pipefail
OUT=${OUT:-/tmp/qmoe_gpu_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ops/test_kernels.py -k "merge or unpermute or refuse" 2>&1 | tail -4
python3 benchmarks/profile_kernels.py --configs dsv3,qwen3 --cases "unpermute" \
  --out "$OUT/prof.json" > "$OUT/prof.log" 2>&1
grep ' us' "$OUT/prof.log"
python3 benchmarks/bench_permute.py --configs dsv3,qwen3,qwen3next,mixtral,gptoss \
  --ops "unpermute(merging_probs),permute backward,fp8 blockwise128: unpermute" \
  --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
grep ' ms ' "$OUT/bench.log" | tail -40
timeout 120 python3 benchmarks/profile_small.py --out "$OUT/small.json" > "$OUT/small.log" 2>&1
head -60 "$OUT/small.log"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/ops/test_compile_ops.py -k "unpermute" 2>&1 | tail -3

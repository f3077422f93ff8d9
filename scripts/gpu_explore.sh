#!/usr/bin/env bash
# One-off device call of this session's exploration (removed when its figures are in docs).
set -uo pipefail
OUT=${OUT:-/tmp/qmoe_gpu_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
python3 benchmarks/profile_kernels.py --configs dsv3,qwen3,mixtral,gptoss \
  --cases "unpermute,fp8 blockwise permute(mask)" --out "$OUT/prof.json" > "$OUT/prof.log" 2>&1
grep ' us' "$OUT/prof.log"
python3 benchmarks/sweep_permute_mask.py --configs dsv3,mixtral,gptoss,qwen3 --rows fp8 \
  --block-t 16 --warps 4,8 --block-h 2048,4096,8192 --ceiling --chain 1,8 \
  --out "$OUT/sweep.json" > "$OUT/sweep.log" 2>&1
grep ' ms ' "$OUT/sweep.log"; tail -3 "$OUT/sweep.log"

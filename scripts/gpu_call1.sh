# Session 6: the unweighted merge (permute backward) per tile, one device call.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
timeout 150 python3 benchmarks/sweep_gather.py --unweighted --configs qwen3,qwen3next,mixtral,dsv3 --out $OUT/sweep_unweighted.json 2>&1 | grep " ms \|equal"

# Session 6 experiments (one device call): FP8 merge tiles and cache hints. Kept as a
# record of what ran; scripts/gpu_check.sh is the check.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee $OUT/env.txt
timeout 400 python3 benchmarks/sweep_gather.py --more --configs dsv3,gptoss,mixtral,qwen3 --out $OUT/sweep_gather_more.json 2>&1 | grep " ms " | grep -v "gather_pairs\|gather_evict"

# Session 6 experiments (one device call): merge tiles x cache hints. Kept as a record of
# what ran; scripts/gpu_check.sh is the check.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee $OUT/env.txt
timeout 420 python3 benchmarks/sweep_gather.py --quick --more --configs dsv3,gptoss,qwen3,mixtral,qwen3next --out $OUT/sweep_gather_quick.json 2>&1 | grep " ms "

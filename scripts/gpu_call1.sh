# Session 6 experiments (one device call): merge tiles x cache hints. Kept as a record of
# what ran; scripts/gpu_check.sh is the check.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee $OUT/env.txt
timeout 300 python3 benchmarks/sweep_gather.py --configs dsv3,gptoss,qwen3 --out $OUT/sweep_gather_evict.json 2>&1 | grep " ms " | grep -v "^[a-z0-9]* gather {"

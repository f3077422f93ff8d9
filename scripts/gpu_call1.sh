# Session 6 experiments (one device call): merge tiles and permute cache hints, plus the
# merge tests on the GPU. Kept as a record of what ran; scripts/gpu_check.sh is the check.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee $OUT/env.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/ops/test_kernels.py -k "merge or unpermute" 2>&1 | tail -3
timeout 200 python3 benchmarks/sweep_permute_mask.py --configs mixtral,gptoss,dsv3,qwen3,qwen3next --block-t 16 --warps 4 --evict evict_first,evict_last --out $OUT/sweep_evict.json 2>&1 | grep " ms "
timeout 150 python3 benchmarks/bench_permute.py --configs dsv3,qwen3,gptoss,mixtral,qwen3next --ops "unpermute(merging_probs),permute backward" --out $OUT/bench_merge.json 2>&1 | grep " ms " | cut -c1-110

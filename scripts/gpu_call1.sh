# Session 6 validation (one device call): GPU tests of the ops the merge kernel serves,
# then the benchmark of the merges (and the permute, for the record).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee $OUT/env.txt
timeout 330 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/ops/test_kernels.py tests/ops/test_permute.py tests/ops/test_fp8.py tests/ops/test_cuda_graph.py tests/ops/test_streams.py > $OUT/tests.log 2>&1
echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/tests.log | tail -15
timeout 220 python3 benchmarks/bench_permute.py --configs dsv3,qwen3,qwen3next,mixtral,gptoss --ops "unpermute(merging_probs),permute backward,unpermute(no probs)" --out $OUT/bench_merge.json 2>&1 | grep " ms " | cut -c1-110

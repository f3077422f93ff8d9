# Session 6 final check (one device call): merge tests on the GPU, then the merge bench.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
timeout 95 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/ops/test_kernels.py -k "permute_unpermute_kernels or merge or unpermute" > $OUT/tests3.log 2>&1
echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/tests3.log | tail -8
timeout 75 python3 benchmarks/bench_permute.py --configs qwen3,dsv3,mixtral,qwen3next,gptoss --ops "unpermute(merging_probs),permute backward" --out $OUT/bench_final.json 2>&1 | grep " ms " | grep -v fp8 | cut -c1-110

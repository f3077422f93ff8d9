# Session 6 validation, part 2 (the files the first call's time limit cut off).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short --durations=5 tests/ops/test_fp8.py tests/ops/test_cuda_graph.py tests/ops/test_streams.py > $OUT/tests2.log 2>&1
echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|s call" $OUT/tests2.log | tail -15

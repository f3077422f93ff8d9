#!/usr/bin/env bash
# One device call: GPU tests, then benchmarks; logs and JSON under $OUT.
#   run: bash scripts/gpu_check.sh [pytest -k expression]
#   QMOE_TESTS="tests/ops/test_kernels.py ..." narrows the test files (default: tests;
#   none: no tests); QMOE_BENCHES=none: no benchmarks;
#   QMOE_PYTEST_ARGS="-m 'not compile'" adds pytest arguments;
#   QMOE_TEST_JOBS=4 runs four pytest processes side by side (test ids dealt round-robin);
#   QMOE_TEST_SECONDS=300 stops the tests after that long (SIGINT: pytest still prints what
#   ran and failed) so the benchmarks run inside the device call's limit (default: no limit).
# The GPU machine has torch and Triton but no network: nothing is installed here,
# qmoe is used from the checkout through PYTHONPATH.
# The device tool brings back at most 8 files from $OUT (more are dropped): this script
# writes env.txt, tests.log and a .json and a .log per benchmark, 8 with the default three;
# extra commands in the same call should write into those or skip files of their own.
set -uo pipefail
OUT=${OUT:-/tmp/qmoe_gpu_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
{
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  # qmoe._triton's C launch: built here (where CUDA is) and whether it serves the launches
  python3 -c "from qmoe import _triton as t; t.use_fast(True); print('C launch', t.fast_status())"
} 2>&1 | tee "$OUT/env.txt"
# torchao for the interop tests: the GPU machine has no network, so carry a wheel
# (pip download --no-deps "torchao>=0.18,<0.19" -d wheels/; run with carry=["wheels"]).
if ls wheels/torchao-*.whl > /dev/null 2>&1; then
  # a wheel is a zip: unpacking it needs no pip (its compiled parts come along)
  python3 -m zipfile -e wheels/torchao-*.whl /tmp/qmoe_ao \
    && export PYTHONPATH="$PYTHONPATH:/tmp/qmoe_ao" && echo "torchao from wheels/" | tee -a "$OUT/env.txt"
fi
K=${1:-}
export QMOE_GPU_CHECK=1
# word-split QMOE_TESTS / QMOE_PYTEST_ARGS (eval: quotes inside them count), -k kept whole
eval "set -- ${QMOE_TESTS:-tests} ${QMOE_PYTEST_ARGS:-}"
# No pkill of leftovers here: timeout signals its whole process group (pytest and its
# compile workers), and tests/test_scripts.py runs this script inside a pytest job, where
# a pkill by name would kill every pytest job at once.
run_pytest() {  # run_pytest LOG ARGS...: one pytest under the time limit; prints its rc
  local log=$1; shift
  timeout --signal=INT --kill-after=30 "${QMOE_TEST_SECONDS:-0}" python3 -m pytest "$@" -q -p no:cacheprovider -rfE --tb=short --durations=25 -o faulthandler_timeout=180 ${K:+-k "$K"} > "$log" 2>&1
  local rc=$?
  [ "$rc" = 124 ] && echo "tests stopped after QMOE_TEST_SECONDS=${QMOE_TEST_SECONDS}" >> "$log"
  echo "pytest rc=$rc" >> "$log"
}
if [ "${QMOE_TESTS:-}" != none ]; then  # QMOE_TESTS=none: benchmarks only
  # QMOE_TEST_JOBS=N: N pytest processes share the GPU (the suite is mostly Triton and
  # Inductor compile time, which is CPU-bound), test ids dealt round-robin so that the
  # files with many kernel variants spread over the jobs (dealt by file, three of four
  # jobs can hit the time limit while one has finished); one tests.log either way
  jobs=${QMOE_TEST_JOBS:-1}
  files=() opts=()
  for a in "$@"; do
    if [ -d "$a" ]; then mapfile -t -O "${#files[@]}" files < <(find "$a" -name 'test_*.py' | sort)
    elif [ -f "${a%%::*}" ]; then files+=("$a"); else opts+=("$a"); fi  # a file or node id
  done
  if [ "$jobs" -gt 1 ]; then
    # The ids, with -k and -m applied. Files are dealt instead when the collection fails
    # (a file that does not import must show its error in a job, not vanish from the
    # ids) or an id's file is not where this directory sees it (pytest prints ids from
    # its rootdir).
    collected=$(timeout 300 python3 -m pytest --collect-only -q -p no:cacheprovider \
                "${files[@]}" "${opts[@]}" ${K:+-k "$K"} 2>&1)
    crc=$?
    mapfile -t ids < <(grep -E '^[^[:space:]]+\.py::' <<< "$collected")
    ok=$([ "$crc" = 0 ] && [ "${#ids[@]}" -gt 0 ] && echo 1)
    for id in "${ids[@]}"; do [ -f "${id%%::*}" ] || { ok=; break; }; done
    if [ -n "$ok" ]; then files=("${ids[@]}")
    else echo "gpu_check: collection rc=$crc; dealing files, not test ids" >&2; fi
  fi
  [ "$jobs" -gt "${#files[@]}" ] && jobs=${#files[@]}
  [ "$jobs" -lt 1 ] && jobs=1
  for ((j = 0; j < jobs; j++)); do
    group=()
    for ((i = j; i < ${#files[@]}; i += jobs)); do group+=("${files[$i]}"); done
    run_pytest "$OUT/tests.$j.part" "${group[@]}" "${opts[@]}" &
  done
  wait
  for ((j = 0; j < jobs; j++)); do echo "=== job $j"; cat "$OUT/tests.$j.part"; rm "$OUT/tests.$j.part"; done > "$OUT/tests.log"
  grep -E "^(FAILED|ERROR)| in [0-9.]+s|stopped|pytest rc" "$OUT/tests.log" | tail -60
fi
# QMOE_BENCHES="permute quantize sweep_permute profile_small" picks benchmarks by name, each
# `python3 -m benchmarks ...` writing $OUT/<name>.json and $OUT/<name>.log: <cmd> or
# bench_<cmd> runs `bench <cmd>` (into bench_<cmd>.*), sweep_<cmd> `sweep <cmd>`, profile_<cmd>
# `profile <cmd>`, cpu or bench_cpu `python3 -m benchmarks.bench_cpu`; a name that is no
# command is skipped, leaving no files (default: bench_permute, bench_quantize and
# bench_compile_fp8)
[ "${QMOE_BENCHES:-}" = none ] && exit 0
for n in ${QMOE_BENCHES:-permute quantize compile_fp8}; do
  case $n in
    cpu | bench_cpu) n=bench_cpu; cmd=(-m benchmarks.bench_cpu) ;;
    bench_* | sweep_* | profile_*) cmd=(-m benchmarks "${n%%_*}" "${n#*_}") ;;
    *) cmd=(-m benchmarks bench "$n"); n=bench_$n ;;
  esac
  python3 "${cmd[@]}" --out "$OUT/$n.json" > "$OUT/$n.log" 2>&1
  if [ "$?" = 2 ] && grep -q "invalid choice" "$OUT/$n.log"; then  # argparse: no such command
    echo "gpu_check: no benchmark '$n' ($(tail -1 "$OUT/$n.log")), skipped" >&2
    rm -f "$OUT/$n.log"; continue
  fi
  grep ' ms ' "$OUT/$n.log" | tail -80
done

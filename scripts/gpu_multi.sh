#!/usr/bin/env bash
# One device call on nvidia-h200-x2 (or -x4): the NCCL dispatcher tests (one process per
# GPU), the two-device op tests and the dsv3 dispatch + combine benchmark.
#   run (kind nvidia-h200-x2): bash scripts/gpu_multi.sh
set -uo pipefail
OUT=${OUT:-/tmp/qmoe_multi_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# NVLink multicast stays off (the device README: the host's GPUs are shared).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/env.txt"
timeout 300 python3 -m pytest tests/test_distributed.py -q -p no:cacheprovider -rfE --tb=short \
  -k nccl 2>&1 | tee "$OUT/tests.log" | tail -5
# ops on the second GPU while the first is current (qmoe._library.on_input_device)
timeout 240 python3 -m pytest tests/ops/test_devices.py -q -p no:cacheprovider -rfE \
  --tb=short 2>&1 | tee "$OUT/tests_devices.log" | tail -5
NG=$(nvidia-smi -L | wc -l)
timeout 240 torchrun --nproc-per-node "$NG" benchmarks/bench_distributed.py --tokens 4096 \
  --hidden 7168 --experts 256 --topk 8 --out "$OUT/bench_distributed.json" \
  > "$OUT/bench_distributed.log" 2>&1; echo "bench rc=$?"; tail -12 "$OUT/bench_distributed.log"

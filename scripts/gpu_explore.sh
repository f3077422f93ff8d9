#!/usr/bin/env bash
# One-off device call of this session's exploration (removed when its figures are in docs).
set -uo pipefail
OUT=${OUT:-/tmp/qmoe_gpu_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
for cfg in dsv3 gptoss; do
  timeout 240 "$NCU" --clock-control none \
    --kernel-name regex:"permute_mask_kernel|permute_scatter_kernel" \
    --launch-skip 4 --launch-count 2 --set full python3 scripts/ncu_fp8_permute.py $cfg \
    > "$OUT/ncu_$cfg.txt" 2>&1
  echo "rc=$? $cfg"; grep -E "^  [a-z_]+kernel|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Executed Ipc A|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Block Limit Reg|Waves Per SM|Executed Instructions  " "$OUT/ncu_$cfg.txt" | head -60
done

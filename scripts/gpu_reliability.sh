#!/usr/bin/env bash
# One device call for docs/reliability.md: streams, scale, small, determinism (twice, two
# processes), then compute-sanitizer memcheck and racecheck over every op. Output in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/qmoe_rel_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
R=scripts/gpu_reliability.py
timeout 200 python3 $R --out "$OUT/rel.json" > "$OUT/rel.log" 2>&1; echo "rel rc=$?"; grep -v '^ ' "$OUT/rel.log" | tail -20
timeout 60 python3 $R --part determinism --out "$OUT/det2.json" > /dev/null 2>&1; echo "det2 rc=$?"
python3 - "$OUT" <<'PY'
import json, sys
a = json.load(open(f"{sys.argv[1]}/rel.json"))["determinism"]["sha256"]
b = json.load(open(f"{sys.argv[1]}/det2.json"))["determinism"]["sha256"]
print("determinism across processes:", a == b)
PY
timeout 60 python3 $R --part sanitize > /dev/null 2>&1  # warm the Triton cache
for tool in memcheck racecheck; do
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout ${SAN_TIMEOUT:-150} compute-sanitizer --tool $tool \
    --error-exitcode 9 python3 $R --part sanitize > "$OUT/$tool.log" 2>&1
  echo "$tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|cases" "$OUT/$tool.log" | tail -3
done

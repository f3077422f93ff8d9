#!/usr/bin/env bash
# One-off device calls (session 10); step picked by $1. Outputs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/qmoe_gpu_out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 QMOE_GPU_CHECK=1; unset TRITON_INTERPRET
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
case "${1:-1}" in
1)
  timeout 200 python3 benchmarks/bench_permute.py --configs dsv3,qwen3,qwen3next,mixtral,gptoss,small --ops sort_chunks --out "$OUT/bench_sort.json" > "$OUT/bench_sort.log" 2>&1; grep " ms \|Error" "$OUT/bench_sort.log" | tail -60
  timeout 110 python3 benchmarks/sweep_sort_chunks.py --fp8 --steps 1 --configs qwen3,mixtral,gptoss --out "$OUT/sweep_wide.json" > "$OUT/sweep_wide.log" 2>&1; grep "% of copy\|Error" "$OUT/sweep_wide.log"
  timeout 90 python3 benchmarks/sweep_sort_chunks.py --fp8 --steps 4 --configs qwen3next,dsv3 --out "$OUT/sweep_words.json" > "$OUT/sweep_words.log" 2>&1; grep "% of copy\|Error" "$OUT/sweep_words.log"
  timeout 120 python3 benchmarks/profile_small.py --cprofile 40 --out "$OUT/small.json" > "$OUT/small.log" 2>&1; tail -80 "$OUT/small.log"
  ;;
2)
  timeout 200 python3 -m pytest tests/ops/test_permute_mask.py tests/ops/test_cuda_graph.py tests/ops/test_streams.py tests/ops/test_quantize_permute.py -m "not compile" -k "pdl or counts_scan or graph or stream or mask" -q -p no:cacheprovider -rfE --tb=short 2>&1 | tee "$OUT/tests.log" | tail -8
  timeout 170 python3 benchmarks/sweep_permute_mask.py --configs dsv3,qwen3,qwen3next,mixtral,gptoss --block-t 16 --warps 4 --pdl 0,1 --rows fp8,bf16 --quant-tiles 4096 --out "$OUT/sweep_pdl.json" > "$OUT/sweep_pdl.log" 2>&1; grep "%\|Error" "$OUT/sweep_pdl.log" | tail -80
  timeout 150 python3 benchmarks/bench_permute.py --configs dsv3,qwen3,qwen3next,mixtral,gptoss,small --ops "permute(mask),permute_with_probs,fp8 blockwise128: permute(mask),fp8 mxfp8: permute(mask),fp8 pertensor: permute(mask),fused blockwise128: quantize+permute" --out "$OUT/bench_pdl.json" > "$OUT/bench_pdl.log" 2>&1; grep " ms \|Error" "$OUT/bench_pdl.log" | tail -60
  ;;
3)
  timeout 150 python3 benchmarks/sweep_map.py --no-breakdown --configs dsv3,qwen3,qwen3next,mixtral,gptoss --block-t 16 --prefetch 2 --warps default --pdl 0,1 --out "$OUT/sweep_map.json" > "$OUT/sweep_map.log" 2>&1; grep "map\|Error" "$OUT/sweep_map.log" | tail -20
  timeout 330 python3 -m pytest tests/ops/test_quantize_permute.py tests/ops/test_fp8.py tests/ops/test_autograd.py tests/ops/test_kernels.py -m "not compile" -k "map or mask or pdl" -q -p no:cacheprovider -rfE --tb=short 2>&1 | tee "$OUT/tests.log" | tail -8
  ;;
4)
  timeout 80 python3 benchmarks/sweep_permute_mask.py --configs mid,small --block-t 16 --warps 4 --pdl 0,1 --rows fp8,bf16 --out "$OUT/sweep_mid.json" > "$OUT/sweep_mid.log" 2>&1; grep "%\|Error" "$OUT/sweep_mid.log" | tail -30
  timeout 420 python3 -m pytest tests/ops/test_compile_ops.py tests/ops/test_compile_fp8.py -q -p no:cacheprovider -rfE --tb=short --durations=10 2>&1 | tee "$OUT/tests.log" | tail -20
  ;;
5)
  timeout 150 python3 -m pytest tests/ops/test_permute_mask.py tests/ops/test_cuda_graph.py -m "not compile" -k "pdl or counts_scan or graph" -q -p no:cacheprovider -rfE --tb=short 2>&1 | tee "$OUT/tests.log" | tail -4
  timeout 90 python3 benchmarks/sweep_permute_mask.py --configs dsv3,gptoss --block-t 16 --warps 4 --pdl 0,1 --rows fp8 --out "$OUT/sweep_pdl2.json" > "$OUT/sweep_pdl2.log" 2>&1; grep "%\|Error" "$OUT/sweep_pdl2.log" | tail -12
  ;;
esac

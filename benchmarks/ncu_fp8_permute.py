"""Driver for Nsight Compute: the fused mask permute and the scatter alone (prebuilt map)
on dsv3-sized FP8 rows (uint8 bits + fp32 blockwise scale rows), each launched once after
warm-up. Results: docs/benchmarks.md, "FP8 rows: the ceiling".

    ncu --clock-control none --kernel-name regex:"permute_mask_kernel|permute_scatter_kernel" \
        --launch-skip 4 --launch-count 2 --set full python3 benchmarks/ncu_fp8_permute.py dsv3

(the first four matching launches are the warm-up's).
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_permute import CONFIGS  # noqa: E402

from qmoe.ops.backend import permute_rows  # noqa: E402
from qmoe.ops.permute_mask import permute_mask_triton  # noqa: E402
from qmoe.ops.row_id_map import make_row_id_map  # noqa: E402

t, h, e, k = CONFIGS[sys.argv[1] if len(sys.argv) > 1 else "dsv3"]
n = t * k
ids = torch.rand(t, e, device="cuda").argsort(dim=1)[:, :k]
mask = torch.zeros(t, e, dtype=torch.bool, device="cuda").scatter_(1, ids, True)
x = torch.randint(0, 255, (t, h), dtype=torch.uint8, device="cuda")
side = torch.rand(t, -(-h // 128), device="cuda")
rid, fill = make_row_id_map(mask, n, False, 1)
so = torch.empty(n, side.shape[1], device="cuda")
for _ in range(2):  # warm-up (compiles), then the profiled launches
    permute_mask_triton(x, mask, n, 1, side=side)
    permute_rows(x, rid, n, fill=fill, side=side, side_out=so)
torch.cuda.synchronize()
permute_mask_triton(x, mask, n, 1, side=side)
permute_rows(x, rid, n, fill=fill, side=side, side_out=so)
torch.cuda.synchronize()
print("done")

"""Drive the mask-map kernels a few times per config, for a hardware profiler.

    ncu --clock-control none -k regex:'mask_|block_scan' --launch-skip 6 --launch-count 6 \
        python3 benchmarks/profile_map.py --configs qwen3next,dsv3

Each config runs the three mask-map launches (``_mask_rows_triton``, what
``make_row_id_map(mask)`` calls on CUDA) ``--calls`` times on the bench's routing (K random
experts a token); nothing is timed here: ncu does the measuring.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_permute import CONFIGS  # noqa: E402

from qmoe.ops.row_id_map import _mask_rows_triton  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="qwen3next,dsv3")
    p.add_argument("--calls", type=int, default=4)
    a = p.parse_args()
    for name in a.configs.split(","):
        t, _, e, k = CONFIGS[name]
        ids = torch.rand(t, e, device="cuda").argsort(dim=1)[:, :k]
        mask = torch.zeros(t, e, dtype=torch.bool, device="cuda").scatter_(1, ids, True)
        for _ in range(a.calls):
            _mask_rows_triton(mask, t * k, 1)
        torch.cuda.synchronize()
        print(name, "done", flush=True)


if __name__ == "__main__":
    main()

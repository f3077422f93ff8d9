"""Sweep the quantize kernel's tiling on the GPU (CUDA-graph medians) to pick defaults.

    python benchmarks/sweep_quantize.py [--out sweep.json]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import copy_bandwidth_gbs, env_info, graph_median_ms, write_json  # noqa: E402

from qmoe.tensors.quantize import quantize_rows_triton  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("sweep_quantize: needs CUDA, skipped")
        return
    copy_bw = copy_bandwidth_gbs()
    rows = []
    for t, h in [(16384, 7168), (16384, 2880)]:
        x = torch.randn(t, h, dtype=torch.bfloat16, device="cuda")
        for mode, bs in [("amax", 128), ("mx_floor", 32)]:
            nbytes = x.numel() * 3 + t * -(-h // bs) * (4 if mode == "amax" else 1)
            for block_r in (1, 2, 4, 8, 16, 32):
                for groups in (1, 2, 4, 8, 16):
                    if block_r * groups * bs not in (2048, 4096, 8192, 16384):
                        continue
                    for nw in (4, 8):
                        tile = (block_r, groups, nw)
                        ms = graph_median_ms(
                            lambda tile=tile, x=x, mode=mode, bs=bs: quantize_rows_triton(
                                x, bs, torch.float8_e4m3fn, mode, tile=tile))
                        pct = 100 * nbytes / (ms * 1e-3) / 1e9 / copy_bw
                        rows.append({"T": t, "H": h, "mode": mode, "tile": tile,
                                     "ms": round(ms, 4), "pct_copy_bw": round(pct, 1)})
                        print(t, h, mode, tile, f"{ms:.4f} ms {pct:.1f}%", file=sys.stderr)
    best = {}
    for r in rows:
        k = f"{r['T']}x{r['H']}-{r['mode']}"
        if k not in best or r["ms"] < best[k]["ms"]:
            best[k] = r
    write_json(a.out, {"bench": "sweep_quantize", "env": env_info(), "copy_GB/s": copy_bw,
                       "best": best, "results": rows})


if __name__ == "__main__":
    main()

"""Quantize kernels: achieved bandwidth against the measured copy bandwidth.

    python benchmarks/bench_quantize.py [--out results.json] [--quick]

Bytes counted per call: read T*H*2 (bf16), write T*H (fp8) plus the scales. Each
recipe is timed three ways, all medians: ``qmoe.quantize`` called eagerly (includes the
Python, autograd and launch overhead), the same call replayed from a CUDA graph (the GPU
time alone: this is what the % of copy bandwidth uses), and the same math as eager
torch ops (``quantize_reference`` on the same device).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    copy_bandwidth_gbs,
    env_info,
    graph_median_ms,
    median_ms,
    write_json,
)

import qmoe  # noqa: E402
from qmoe.tensors.quantize import quantize_reference  # noqa: E402

CONFIGS = {  # name: (T, H)
    "dsv3": (16384, 7168),
    "qwen3": (16384, 4096),
    "gptoss": (16384, 2880),
    "small": (128, 7168),
}
RECIPES = {
    "pertensor-e4m3": qmoe.PerTensor(),
    "pertensor-given-scale": qmoe.PerTensor(),
    "blockwise128-e4m3": qmoe.Blockwise(),
    "blockwise128-pow2": qmoe.Blockwise(power_of_two_scale=True),
    "mxfp8-e4m3": qmoe.MXFP8(),
    "mxfp8-e5m2": qmoe.MXFP8(torch.float8_e5m2),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="small sizes (CPU smoke run)")
    a = p.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    configs = {"tiny": (256, 1024)} if a.quick or dev == "cpu" else CONFIGS
    copy_bw = copy_bandwidth_gbs((1 << 30) if dev == "cuda" else (1 << 26))
    rows = []
    for cname, (t, h) in configs.items():
        x = torch.randn(t, h, dtype=torch.bfloat16, device=dev)
        for rname, recipe in RECIPES.items():
            kw = {}
            if rname == "pertensor-given-scale":
                kw["scale"] = (x.abs().amax().float() / 448.0).reshape(())
            q = qmoe.quantize(x, recipe, **kw)
            s = q.raw_scale
            nbytes = x.numel() * 2 + q.qdata.numel() + s.numel() * s.element_size()
            fn = lambda x=x, r=recipe, kw=kw: qmoe.quantize(x, r, **kw)
            ms_eager = median_ms(fn)
            ms = graph_median_ms(fn) or ms_eager
            ms_ref = median_ms(lambda x=x, r=recipe, kw=kw: quantize_reference(x, r, **kw))
            gbs = nbytes / (ms * 1e-3) / 1e9
            rows.append({
                "config": cname, "T": t, "H": h, "recipe": rname, "bytes": nbytes,
                "graph_ms": round(ms, 4), "eager_ms": round(ms_eager, 4), "GB/s": round(gbs, 1),
                "pct_copy_bw": round(100 * gbs / copy_bw, 1),
                "torch_eager_ms": round(ms_ref, 4),
                "speedup_vs_torch_eager": round(ms_ref / ms_eager, 2),
            })
            print(f"{cname:>7} {rname:>22}: graph {ms:8.4f} ms {gbs:8.1f} GB/s "
                  f"{100 * gbs / copy_bw:5.1f}% of copy; eager {ms_eager:8.4f} ms; "
                  f"torch ops {ms_ref:8.4f} ms", file=sys.stderr)
    write_json(a.out, {"bench": "quantize", "env": env_info(), "copy_GB/s": round(copy_bw, 1),
                       "results": rows})


if __name__ == "__main__":
    main()

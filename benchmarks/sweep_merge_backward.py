"""Sweep the weighted merge's backward in one pass (``merge_backward_triton``: routes a
step x columns a tile x warps), the tilings ``backend.merge_backward_tile`` chooses from.
CUDA-graph medians, % of copy bandwidth. Results, with the two-kernel form as a reference
(a weighted scatter of the gradient, then a weight-gradient kernel into a zeroed fp32
[T, P], then a cast): docs/benchmarks.md, "Merge backward (`merge_backward_tile`)".

    python benchmarks/sweep_merge_backward.py [--out F] [--configs dsv3,mixtral]
        [--kb 2,4] [--block-h 1024,2048] [--warps 4,8]

Bytes as bench_permute.py's "unpermute backward(probs)": T gradient rows and N input rows
read, N rows written. Each variant's grad_inp is checked bit-exact against the weighted
scatter's (``permute_rows``), and its weights' gradient against fp32 torch dot products,
before it is timed.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_permute import CONFIGS  # noqa: E402
from common import (  # noqa: E402
    copy_bandwidth_gbs,
    env_info,
    int_list,
    variant_recorder,
    write_json,
)

import qmoe  # noqa: E402
from qmoe.ops.backend import merge_weight_grad, permute_rows  # noqa: E402
from qmoe.ops.unpermute import merge_backward_triton  # noqa: E402


def run_config(name, copy_bw, kbs, bhs, warps) -> list[dict]:
    t, h, e, k = CONFIGS[name]
    n = t * k
    ids = torch.rand(t, e, device="cuda").argsort(dim=1)[:, :k]
    mask = torch.zeros(t, e, dtype=torch.bool, device="cuda").scatter_(1, ids, True)
    x = torch.randn(t, h, dtype=torch.bfloat16, device="cuda")
    _, rid = qmoe.moe_permute(x, mask, n)
    probs = torch.rand(t, e, device="cuda")
    y = torch.randn(n, h, dtype=torch.bfloat16, device="cuda")
    g = torch.randn(t, h, dtype=torch.bfloat16, device="cuda")
    nbytes = (t + 2 * n) * h * 2
    rows = []
    record = variant_recorder(rows, name, nbytes, copy_bw, 36)

    ref_gi, ref_gw = permute_rows(g, rid, n, probs), merge_weight_grad(g, y, rid, e)
    for kb in kbs:
        for bh in bhs:
            for nw in warps:
                kw = dict(kb=kb, block_h=bh, num_warps=nw)
                gi, gw = merge_backward_triton(g, y, rid, probs, **kw)
                assert torch.equal(gi, ref_gi), (name, kw)
                torch.testing.assert_close(gw, ref_gw, rtol=1e-5, atol=1e-3)
                record(f"one pass kb {kb} bh {bh} warps {nw}",
                       lambda kw=kw: merge_backward_triton(g, y, rid, probs, **kw))
    record("one pass, merge_backward_tile's tiling",
           lambda: merge_backward_triton(g, y, rid, probs))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--configs", default="dsv3,qwen3,qwen3next,mixtral,gptoss")
    ap.add_argument("--kb", default="2,4")
    ap.add_argument("--block-h", default="1024,2048")
    ap.add_argument("--warps", default="4,8")
    a = ap.parse_args()
    copy_bw = copy_bandwidth_gbs()
    rows = []
    for name in a.configs.split(","):
        rows += run_config(name, copy_bw, int_list(a.kb), int_list(a.block_h), int_list(a.warps))
    write_json(a.out, {"bench": "sweep_merge_backward", "env": env_info(),
                       "copy_bw_gbs": round(copy_bw, 1), "args": vars(a), "results": rows})


if __name__ == "__main__":
    main()

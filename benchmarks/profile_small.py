"""Where the host time of a small eager call goes (issue 3's "small" target).

    python3 benchmarks/profile_small.py [--config small] [--out small.json] [--cprofile 25]

For each case: host microseconds per call with calls issued back to back (the best of five
rounds of ``--calls / 5`` calls, one synchronize after each: the CPU-bound rate an eager
training step sees), the kernels one call launches (torch.profiler), and the GPU time from
a CUDA-graph replay. Then a cProfile of ``moe_permute(mask)`` (top functions by own time).
Baselines: empty Triton kernels by argument count and kind, ``torch.empty``, and the mask
map built with three launches and with one (``_mask_rows_triton(..., one_launch=)``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_permute import CONFIGS  # noqa: E402
from common import env_info, graph_median_ms, host_us, write_json  # noqa: E402

import qmoe  # noqa: E402
from qmoe.ops.row_id_map import _mask_rows_triton  # noqa: E402


@triton.jit
def _empty1(x):  # (1,) any
    pass


@triton.jit
def _empty24(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, n0, n1, n2, n3, n4, n5, n6,
             n7, F0: tl.constexpr, F1: tl.constexpr, F2: tl.constexpr, F3: tl.constexpr):
    pass


@triton.jit
def _empty_ptrs12(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11):
    pass


@triton.jit
def _empty_ints20(a0, n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, n12, n13, n14, n15,
                  n16, n17, n18, n19):
    pass


_NOSPEC = tuple(f"n{i}" for i in range(20))


@triton.jit(do_not_specialize=_NOSPEC)
def _empty_ints20_nospec(a0, n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, n12, n13, n14,
                         n15, n16, n17, n18, n19):
    pass


def launches(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="small")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--cprofile", type=int, default=25, help="top functions printed")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    t, h, e, k = CONFIGS[a.config]
    n = t * k
    dev = "cuda"
    x = torch.randn(t, h, dtype=torch.bfloat16, device=dev)
    ids = torch.rand(t, e, device=dev).argsort(dim=1)[:, :k].contiguous()
    mask = torch.zeros(t, e, dtype=torch.bool, device=dev).scatter_(1, ids, True)
    probs = torch.rand(t, e, device=dev)
    y = torch.randn(n, h, dtype=torch.bfloat16, device=dev)
    _, rid = qmoe.moe_permute(x, mask, n)
    q = qmoe.quantize(x, qmoe.Blockwise())
    ints = [0] * 8
    cases = {
        "triton empty kernel, 1 arg": lambda: _empty1[(1,)](x),
        "triton empty kernel, 24 args": lambda: _empty24[(1,)](
            *([x] * 12), *ints, F0=1, F1=2, F2=3, F3=4),
        "triton empty kernel, 12 tensors": lambda: _empty_ptrs12[(1,)](*([x] * 12)),
        "triton empty kernel, 1 tensor + 20 ints": lambda: _empty_ints20[(1,)](x, *range(20)),
        "... same, ints do_not_specialize": lambda: _empty_ints20_nospec[(1,)](x, *range(20)),
        "torch.empty": lambda: torch.empty(n, h, dtype=x.dtype, device=dev),
        "x.new_empty": lambda: x.new_empty((n, h)),
        "mask map, three launches": lambda: _mask_rows_triton(mask, n, 1, one_launch=False),
        "mask map, one launch": lambda: _mask_rows_triton(mask, n, 1, one_launch=True),
        "qmoe::make_row_id_map(mask)": lambda: torch.ops.qmoe.make_row_id_map(mask, n, False, 1),
        "qmoe::permute (rows only)": lambda: torch.ops.qmoe.permute(x, rid, None, n),
        "moe_permute(mask)": lambda: qmoe.moe_permute(x, mask, n),
        "moe_permute(index)": lambda: qmoe.moe_permute(x, ids, n, map_type="index"),
        "moe_permute_with_probs(mask)": lambda: qmoe.moe_permute_with_probs(x, probs, mask, n),
        "moe_unpermute(merging_probs)": lambda: qmoe.moe_unpermute(y, rid, probs),
        "moe_unpermute(no probs)": lambda: qmoe.moe_unpermute(y, rid),
        "fp8 blockwise moe_permute(mask)": lambda: qmoe.moe_permute(q, mask, n),
    }
    rows = []
    for name, fn in cases.items():
        us = host_us(fn, a.calls)
        nl = launches(fn)
        g = graph_median_ms(fn, rep=50) if "empty" not in name[-12:] else None
        rows.append({"case": name, "host_us": round(us, 1), "launches": nl,
                     "graph_us": None if g is None else round(g * 1e3, 1)})
        print(f"{name:>34}: host {us:7.1f} us/call, {nl} launches, graph "
              f"{'-' if g is None else f'{g * 1e3:.1f}'} us", file=sys.stderr)
    prof = cProfile.Profile()
    fn = cases["moe_permute(mask)"]
    prof.enable()
    for _ in range(a.calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.cprofile)
    print(s.getvalue(), file=sys.stderr)
    write_json(a.out, {"bench": "profile_small", "env": env_info(), "config": a.config,
                       "calls": a.calls, "results": rows, "cprofile": s.getvalue()})


if __name__ == "__main__":
    main()

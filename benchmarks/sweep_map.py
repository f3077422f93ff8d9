"""Where the time of a permute goes, kernel by kernel, and the mask-map tiling sweep.

    python benchmarks/sweep_map.py [--out results.json] [--configs dsv3,qwen3next]

1. ``make_row_id_map(mask)`` (three launches) for each ``MapTiling``: tokens per block
   (``--block-t``, 8 to 32 by default: one row of counts per block) x warps (``--warps``:
   half, the default, twice) x rows the map pass loads ahead (``--prefetch``, 2 or all), replayed
   from a CUDA graph (median ms); the best goes in ``best_map``.
2. A kernel-level breakdown (``torch.profiler``, CUDA time per call, averaged over 20 calls)
   of: bf16 ``moe_permute`` end to end, the FP8 (blockwise) permute, the fused MXFP8
   quantize-and-permute and the merge with probs, so the gap between a whole op and its
   main kernel is measured rather than guessed.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections import defaultdict

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_permute import CONFIGS  # noqa: E402
from common import env_info, graph_median_ms, write_json  # noqa: E402

import qmoe  # noqa: E402
from qmoe.ops.row_id_map import MapTiling, _mask_rows_triton, map_tiling  # noqa: E402


def kernel_breakdown(fn, iters: int = 20) -> dict[str, float]:
    """CUDA time per call of each kernel ``fn`` launches (us), from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name[:60]] += ev.device_time / iters
    return {k: round(v, 2) for k, v in sorted(per.items(), key=lambda kv: -kv[1])}


def run_config(name: str, breakdown: bool = True, block_ts=(8, 16, 32),
               aheads=(2, 32), warps_spec: str = "auto", pdls=(None,)) -> dict:
    t, h, e, k = CONFIGS[name]
    n = t * k
    dev = "cuda"
    x = torch.randn(t, h, dtype=torch.bfloat16, device=dev)
    ids = torch.rand(t, e, device=dev).argsort(dim=1)[:, :k]
    mask = torch.zeros(t, e, dtype=torch.bool, device=dev).scatter_(1, ids, True)
    probs = torch.rand(t, e, device=dev)
    y = torch.randn(n, h, dtype=torch.bfloat16, device=dev)
    out = {"config": name, "T": t, "H": h, "E": e, "K": k, "map": [], "breakdown": {}}
    nw0 = map_tiling(t, e).num_warps
    warps = {max(1, nw0 // 2), nw0, min(8, nw0 * 2)}
    if warps_spec != "auto":  # e.g. "default,row": map_tiling's, one expert a thread
        named = {"default": nw0, "row": max(1, triton.next_power_of_2(e) // 32)}
        warps = {named[w] if w in named else int(w) for w in warps_spec.split(",")}
    warps = sorted(warps)
    # tokens per block x warps x rows loaded ahead (2, or the whole block)
    tilings = dict.fromkeys(MapTiling(bt, nw, min(ahead, bt))
                            for bt, nw, ahead in itertools.product(block_ts, warps, aheads))
    for tiling, pdl in itertools.product(tilings, pdls):
        ms = graph_median_ms(lambda tiling=tiling, pdl=pdl: _mask_rows_triton(
            mask, n, 1, tiling, pdl=pdl), rep=60)
        out["map"].append({**tiling._asdict(), "pdl": pdl, "ms": round(ms, 4)})
        print(f"{name} map {tiling} pdl={pdl}: {ms:.4f} ms", file=sys.stderr)
    out["best_map"] = min(out["map"], key=lambda r: r["ms"])
    out["default_map"] = {**map_tiling(t, e)._asdict()}
    _, rid = qmoe.moe_permute(x, mask, n)
    q = qmoe.quantize(x, qmoe.Blockwise())
    cases = {
        "permute(mask) bf16": lambda: qmoe.moe_permute(x, mask, n),
        "permute(mask) fp8 blockwise": lambda: qmoe.moe_permute(q, mask, n),
        "fused mxfp8 quantize+permute": lambda: qmoe.moe_permute(x, mask, n,
                                                                 quantize=qmoe.MXFP8()),
        "unpermute(merging_probs) bf16": lambda: qmoe.moe_unpermute(y, rid, probs),
    }
    for case, fn in cases.items() if breakdown else ():
        out["breakdown"][case] = kernel_breakdown(fn)
        print(name, case, out["breakdown"][case], file=sys.stderr)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--configs", default="dsv3,qwen3,qwen3next,mixtral,gptoss,small")
    p.add_argument("--no-breakdown", action="store_true", help="only the map sweep")
    p.add_argument("--block-t", default="8,16,32", help="tokens per block to try")
    p.add_argument("--prefetch", default="2,32", help="rows loaded ahead to try (capped)")
    p.add_argument("--warps", default="auto",
                   help="'auto' (half, map_tiling's, twice) or a list of ints, 'default' "
                        "(map_tiling's) and 'row' (one expert a thread: next_pow2(E) / 32)")
    p.add_argument("--pdl", default="auto", help="comma list of auto/0/1: the scan and the "
                   "map pass as programmatic dependent launches (auto: Hopper or newer)")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("sweep_map: needs CUDA, skipped")
        return
    rows = []
    for c in a.configs.split(","):  # written after each config: a cut-off run keeps the rest
        rows.append(run_config(c, not a.no_breakdown,
                               [int(v) for v in a.block_t.split(",")],
                               [int(v) for v in a.prefetch.split(",")],
                               a.warps, [None if v == "auto" else bool(int(v))
                                         for v in a.pdl.split(",")]))
        write_json(a.out, {"bench": "sweep_map", "env": env_info(), "results": rows})


if __name__ == "__main__":
    main()

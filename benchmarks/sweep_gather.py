"""Sweep the merge (unpermute gather) kernel: tile x warps x pipeline stages x cache
hint, and a two-routes-a-step variant, next to the whole ``moe_unpermute`` op (CUDA-graph
medians); ``--more`` adds an even split of H over the column programs and the FP8 merge.
The weighted merge's backward has a sweep of its own, ``sweep_merge_backward.py``.
Results: docs/benchmarks.md, "bf16 merge tiles (`merge_tile`)" and "FP8 merge
(`fp8_merge_tile`; no load-ahead)".

    python benchmarks/sweep_gather.py [--out sweep_gather.json] [--configs dsv3,qwen3]

Bytes as in bench_permute.py's "unpermute(merging_probs)": N rows read, T rows written.
The variant kernels live here; the two-routes-a-step form ("gather_pairs") is
``unpermute_gather_kernel``'s PAIRS. Each sums the same rows in the same order
(bit-identical, checked in the run).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_permute import CONFIGS  # noqa: E402
from common import copy_bandwidth_gbs, env_info, graph_median_ms, write_json  # noqa: E402

import qmoe  # noqa: E402
from qmoe.ops._kernels.permute import (  # noqa: E402
    _checked_row,
    _merge_add,
    _route,
    check_routes,
    unpermute_fp8_kernel,
    unpermute_gather_kernel,
)
from qmoe.ops.backend import assert_options  # noqa: E402
from qmoe.ops.row_id_map import num_slots  # noqa: E402


@triton.jit
def gather_split_kernel(
    inp_ptr,  # (N, H) any float dtype, contiguous
    out_ptr,  # (T, H) output dtype, contiguous
    map_ptr,  # (T, 2S+1) int32
    w_ptr,  # (T, P) merging weights, row stride stride_w (read only if HAS_W)
    H,
    S,
    N_IN,
    stride_w,
    P,
    CHUNK,  # columns a program: cdiv(H, programs along axis 1), <= BLOCK_H
    HAS_W: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """unpermute_gather_kernel with H split evenly over the column programs (H = 7168 in
    two 3584-column programs of a 4096 tile, not 4096 + 3072)."""
    t = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, BLOCK_H)
    cols = tl.program_id(1) * CHUNK + lane
    hmask = (cols < H) & (lane < CHUNK)
    mrow = map_ptr + t * (2 * S + 1)
    n = tl.minimum(tl.load(mrow + 2 * S), S)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    bad = tl.zeros((1,), dtype=tl.int32) + (n < 0).to(tl.int32)
    wrow = w_ptr + t * stride_w
    d_next, w_next, c_next = _route(mrow, S, 0, n, wrow, P, HAS_W)
    for s in range(0, n):
        d, w, cbad = d_next, w_next, c_next
        d_next, w_next, c_next = _route(mrow, S, s + 1, n, wrow, P, HAS_W)
        d, lmask, bad = _checked_row(d, N_IN, hmask, bad, BLOCK_H)
        x = tl.load(inp_ptr + d * H + cols, mask=lmask, other=0.0).to(tl.float32)
        acc, bad = _merge_add(acc, x, w, cbad, bad, HAS_W)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=hmask)
    check_routes(bad)


@triton.jit
def gather_r_kernel(
    inp_ptr,  # (N, H) any float dtype, contiguous
    out_ptr,  # (T, H) output dtype, contiguous
    map_ptr,  # (T, 2S+1) int32
    w_ptr,  # (T, P) merging weights, row stride stride_w (read only if HAS_W)
    H,
    S,
    N_IN,
    stride_w,
    P,
    HAS_W: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EVICT: tl.constexpr = "",
    R: tl.constexpr = 2,  # routes whose rows are in flight together
):
    """unpermute_gather_kernel with R routes' rows loaded a step, then summed in route
    order (same sums); no load-ahead of the next step's map entries."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = cols < H
    mrow = map_ptr + t * (2 * S + 1)
    n = tl.minimum(tl.load(mrow + 2 * S), S)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    bad = tl.zeros((1,), dtype=tl.int32) + (n < 0).to(tl.int32)
    wrow = w_ptr + t * stride_w
    for s in range(0, n, R):
        xs = ()
        ws = ()
        cs = ()
        for u in tl.static_range(R):
            d, w, c = _route(mrow, S, s + u, n, wrow, P, HAS_W)
            d, m, bad = _checked_row(d, N_IN, hmask, bad, BLOCK_H)
            live = (cols * 0 + s + u) < n
            xs = xs + (tl.load(inp_ptr + d * H + cols, mask=m & live, other=0.0,
                               eviction_policy=EVICT).to(tl.float32),)
            ws = ws + (w,)
            cs = cs + (c,)
        for u in tl.static_range(R):
            acc2, bad = _merge_add(acc, xs[u], ws[u], cs[u], bad, HAS_W)
            acc = tl.where((cols * 0 + s + u) < n, acc2, acc)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=hmask,
             eviction_policy=EVICT)
    check_routes(bad)


def _sweep_split_and_fp8(name, t, h, n, y, back, rid, probs, s, ref, record, quick):
    """The even-split merge and the FP8 (blockwise) merge tiles (``--more``; ``quick``:
    the FP8 merge's small tiles only)."""
    rows = []
    if quick:
        return rows + _sweep_fp8(name, t, h, n, y, back, rid, probs, s, record, quick)
    for parts in (2, 3, 4):
        chunk = triton.cdiv(h, parts)
        bh = triton.next_power_of_2(chunk)
        for nw in (4, 8):
            record("gather_split", lambda chunk=chunk, bh=bh, nw=nw, parts=parts:
                   gather_split_kernel[(t, parts)](
                       y, back, rid, probs, h, s, n, probs.stride(0), probs.shape[1],
                       chunk, HAS_W=True, BLOCK_H=bh, num_warps=nw, **assert_options()),
                   parts=parts, BLOCK_H=bh, num_warps=nw)
    back.fill_(float("nan"))
    gather_split_kernel[(t, 2)](y, back, rid, probs, h, s, n, probs.stride(0),
                                probs.shape[1], triton.cdiv(h, 2), HAS_W=True,
                                BLOCK_H=triton.next_power_of_2(triton.cdiv(h, 2)),
                                **assert_options())
    rows.append({"config": name, "kernel": "gather_split", "equal_to_op":
                 torch.equal(back, ref)})
    return rows + _sweep_fp8(name, t, h, n, y, back, rid, probs, s, record, quick)


def _sweep_fp8(name, t, h, n, y, back, rid, probs, s, record, quick):
    """The FP8 (blockwise) merge per tile x warps x cache hint."""
    # the FP8 merge (blockwise rows: fp8 bits + fp32 scale per 128 columns)
    qy = qmoe.quantize(y, qmoe.Blockwise())
    qbits, qs = qy.qdata.view(torch.uint8), qy.raw_scale
    fbytes = n * (h + qs.shape[1] * 4) + t * h * 2
    record("moe_unpermute(fp8 blockwise, merging_probs)",
           lambda: qmoe.moe_unpermute(qy, rid, probs), nbytes=fbytes)
    fp8_tiles = ((1024, (1, 2, 4)), (2048, (2, 4, 8)), (4096, (4, 8, 16)), (8192, (8, 16)))
    if quick:
        fp8_tiles = ((256, (1,)), (512, (1, 2)), (1024, (1, 2)), (2048, (4,)), (4096, (8,)))
    for bh, nws in fp8_tiles:
        for nw in nws:
            for ev in ("", "evict_first"):
                record("unpermute_fp8 blockwise", lambda bh=bh, nw=nw, ev=ev:
                       unpermute_fp8_kernel[(t, triton.cdiv(h, bh))](
                           qbits, qs, back, rid, probs, h, s, n, qs.shape[1],
                           probs.stride(0), probs.shape[1], LAYOUT=1, BS=128, MB=3, BIAS=7,
                           HW_CAST=True, HAS_W=True, BLOCK_H=bh, EVICT=ev, num_warps=nw,
                           **assert_options()),
                       nbytes=fbytes, BLOCK_H=bh, num_warps=nw, evict=ev)
    return []


def sweep_config(name: str, copy_bw: float, more: bool = False,
                 quick: bool = False, weighted: bool = True) -> list[dict]:
    rows = []
    t, h, e, k = CONFIGS[name]
    n = t * k
    x = torch.randn(t, h, dtype=torch.bfloat16, device="cuda")
    ids = torch.rand(t, e, device="cuda").argsort(dim=1)[:, :k]
    mask = torch.zeros(t, e, dtype=torch.bool, device="cuda").scatter_(1, ids, True)
    probs = torch.rand(t, e, device="cuda")
    _, rid = qmoe.moe_permute(x, mask, n)
    s = num_slots(rid)
    y = torch.randn(n, h, dtype=x.dtype, device="cuda")
    back = torch.empty(t, h, dtype=x.dtype, device="cuda")
    nbytes = (t + n) * h * 2  # rows only, as bench_permute's merges
    merging = probs if weighted else None
    ref = qmoe.moe_unpermute(y, rid, merging)

    def record(kernel, fn, nbytes=nbytes, **tile):
        ms = graph_median_ms(fn, rep=100)
        pct = 100 * nbytes / (ms * 1e-3) / 1e9 / copy_bw
        rows.append({"config": name, "kernel": kernel, **tile, "ms": round(ms, 4),
                     "pct_copy_bw": round(pct, 1)})
        print(name, kernel, tile, f"{ms:.4f} ms {pct:.1f}%", file=sys.stderr, flush=True)

    def launch(kernel, bh, nw, ns, ev="", **extra):
        kernel[(t, triton.cdiv(h, bh))](y, back, rid, probs, h, s, n, probs.stride(0),
                                        probs.shape[1], HAS_W=weighted, BLOCK_H=bh, EVICT=ev,
                                        num_warps=nw, num_stages=ns, **assert_options(), **extra)

    record(f"moe_unpermute({'merging_probs' if weighted else 'no probs'})",
           lambda: qmoe.moe_unpermute(y, rid, merging))
    wide = ((1024, (1, 2, 4)), (2048, (2, 4, 8)), (4096, (4, 8, 16)), (8192, (8, 16)))
    small = ((256, (1,)), (512, (1, 2)), (1024, (1, 2)))
    one_route = {"PAIRS": False}
    cases = [("gather", unpermute_gather_kernel, "", wide, one_route),
             ("gather evict_first", unpermute_gather_kernel, "evict_first", small, one_route),
             ("gather_pairs", unpermute_gather_kernel, "", ((4096, (4, 8)), (8192, (8,))),
              {"PAIRS": True}),
             ("gather_pairs evict_first", unpermute_gather_kernel, "evict_first", small,
              {"PAIRS": True})]
    cases += [(f"gather_r R={r} evict_first", gather_r_kernel, "evict_first", small, {"R": r})
              for r in (2, 4)]
    if quick:  # the small evict-first tiles, among them the launchers' (backend.merge_tile)
        cases = [c for c in cases if c[3] is small]
    if not weighted:  # the merge kernel (two routes a step) against one route a step
        one = ((h, (max(1, min(8, h // 512)),)),) if h & (h - 1) == 0 and h <= 4096 else ()
        cases = [("gather (pairs)", unpermute_gather_kernel, "evict_first",
                  ((512, (1,)), (1024, (2,))), {"PAIRS": True}),
                 ("gather (pairs)", unpermute_gather_kernel, "", one, {"PAIRS": True}),
                 ("gather_r R=1", gather_r_kernel, "", one, {"R": 1}),
                 ("gather_r R=1 evict_first", gather_r_kernel, "evict_first", ((512, (1,)),),
                  {"R": 1})]
    for kname, kernel, ev, tiles, extra in cases:
        back.fill_(float("nan"))
        launch(kernel, 4096, 8, 3, ev, **extra)
        same = torch.equal(back, ref)
        rows.append({"config": name, "kernel": kname, "equal_to_op": same})
        print(name, kname, "equal to moe_unpermute:", same, file=sys.stderr)
        for bh, nws in tiles:
            for nw in nws:
                for ns in ((1, 3) if bh == 4096 and tiles is wide else (3,)):
                    record(kname, lambda kernel=kernel, bh=bh, nw=nw, ns=ns, ev=ev,
                           extra=extra: launch(kernel, bh, nw, ns, ev, **extra),
                           BLOCK_H=bh, num_warps=nw, num_stages=ns)
    if more:
        rows += _sweep_split_and_fp8(name, t, h, n, y, back, rid, probs, s, ref, record,
                                     quick)
    # the ceiling: a copy of the same bytes (read N*H, write T*H is not a copy; use
    # (N + T) * H / 2 elements each way)
    src = torch.empty((n + t) * h // 2, dtype=x.dtype, device="cuda")
    dst = torch.empty_like(src)
    record("same-bytes copy", lambda: dst.copy_(src))
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--configs", default="dsv3,qwen3")
    p.add_argument("--more", action="store_true",
                   help="also the even-split merge and the FP8 blockwise merge tiles")
    p.add_argument("--unweighted", action="store_true",
                   help="merge without weights (the permute backward): the merge kernel at "
                        "512 columns and at one tile, against one route a step")
    p.add_argument("--quick", action="store_true",
                   help="only the small evict-first tiles (the forms that won)")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("sweep_gather: needs CUDA, skipped")
        return
    copy_bw = copy_bandwidth_gbs()
    rows = [r for name in a.configs.split(",")
            for r in sweep_config(name, copy_bw, a.more, a.quick, not a.unweighted)]
    best = {}
    for r in rows:
        key = f"{r['config']}-{r['kernel']}"
        if "ms" in r and (key not in best or r["ms"] < best[key]["ms"]):
            best[key] = r
    write_json(a.out, {"env": env_info(), "copy_bw_gbs": copy_bw, "best": best, "rows": rows})


if __name__ == "__main__":
    main()

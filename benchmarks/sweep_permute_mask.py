"""Tiling sweep of the mask permute that builds its map in the scatter launch.

    python benchmarks/sweep_permute_mask.py [--out results.json] [--configs dsv3,qwen3next]

For each config: ``qmoe::permute_mask``'s kernels (counts, scan, fused map + scatter)
replayed from a CUDA graph (median ms) for each count block (``--block-t``) x warps of the
fused kernel (``--warps``) x tokens per program (``--tokens``), bf16 rows and FP8 (uint8)
rows; next to them the two-step path (``make_row_id_map`` then the scatter) and the
scatter alone on a prebuilt map, measured in the same run. % is of the measured copy
bandwidth, bytes as in ``bench_permute.py``.

``--block-h`` adds fused cases at other columns a program; ``--ceiling`` adds what the op's
bytes cost without a map: a copy of the same bytes, and a kernel that writes each row K
times (to consecutive rows, and to rows in a random order: the scatter's access pattern
with its destinations precomputed). ``--chain R`` captures R calls on R distinct inputs in
one graph and reports the time per call (the graph launch and each call's ramp-up shared
out: a steady-state rate, next to the single call's). ``--rows fp8`` skips the bf16 rows.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_permute import CONFIGS  # noqa: E402
from common import copy_bandwidth_gbs, env_info, graph_median_ms, write_json  # noqa: E402

from qmoe.ops.backend import permute_rows, scatter_tile  # noqa: E402
from qmoe.ops.permute_index import permute_index_triton  # noqa: E402
from qmoe.ops.permute_mask import fused_map_tiling, permute_mask_triton  # noqa: E402
from qmoe.ops.quantize_permute import (  # noqa: E402
    quantize_permute_mask_triton,
    quantize_permute_triton,
)
from qmoe.ops.row_id_map import MapTiling, make_row_id_map  # noqa: E402


@triton.jit
def broadcast_kernel(
    x_ptr,  # (T, H) rows, contiguous
    out_ptr,  # (N, H) same dtype
    dest_ptr,  # (T, K) int64: the output rows of each token
    side_ptr,  # (T, NS) side rows (read only if HAS_SIDE)
    side_out_ptr,  # (N, NS)
    H,
    NS,
    K: tl.constexpr,
    HAS_SIDE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """The ceiling of a scatter: token t's row to rows ``dest[t]``, no map to read."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = cols < H
    x = tl.load(x_ptr + t * H + cols, mask=hm)
    d = tl.load(dest_ptr + t * K + tl.arange(0, K))
    tl.store(out_ptr + d[:, None] * H + cols[None, :], tl.broadcast_to(x[None, :], (K, BLOCK_H)),
             mask=hm[None, :])
    if HAS_SIDE and tl.program_id(1) == 0:
        sc = tl.arange(0, BLOCK_S)
        sm = sc < NS
        s = tl.load(side_ptr + t * NS + sc, mask=sm)
        tl.store(side_out_ptr + d[:, None] * NS + sc[None, :],
                 tl.broadcast_to(s[None, :], (K, BLOCK_S)), mask=sm[None, :])


def broadcast(x, dest, out, side=None, side_out=None):
    t, h = x.shape
    k = dest.shape[1]
    bh, nw, _ = scatter_tile(h, x.element_size(), False)
    ns = side.shape[1] if side is not None else 0
    broadcast_kernel[(t, -(-h // bh))](x, out, dest, side, side_out, h, ns, K=k,
                                       HAS_SIDE=side is not None, BLOCK_H=bh,
                                       BLOCK_S=triton.next_power_of_2(max(ns, 1)), num_warps=nw)
    return out


def chained(fn, inputs):
    """One call per input (``fn(*inp)``), all in one graph."""
    def run():
        for args in inputs:
            fn(*args)
    return run


def two_step(x, mask, n, side=None, side_out=None):
    rid, fill = make_row_id_map(mask, n, False, 1)
    return permute_rows(x, rid, n, fill=fill, side=side, side_out=side_out), rid


def run_config(name: str, copy_bw: float, block_ts, warps, tokens=(1,), quant_tiles=(),
               quant_block=128, reg_routes=(None,), block_hs=(), ceiling=False, chain=1,
               kinds=("bf16", "fp8"), pdls=(None,), index=False,
               quant_steps=(1,)) -> list[dict]:
    t, h, e, k = CONFIGS[name]
    n = t * k
    ids = torch.rand(t, e, device="cuda").argsort(dim=1)[:, :k]
    mask = torch.zeros(t, e, dtype=torch.bool, device="cuda").scatter_(1, ids, True)
    rows = []
    for dname in kinds:
        rows += run_rows(name, dname, mask, copy_bw, block_ts, warps, tokens, reg_routes,
                         block_hs, ceiling, chain, pdls, ids if index else None)
    if quant_tiles:
        rows += quantize_cases(name, mask, n, copy_bw, quant_tiles, warps, reg_routes, pdls,
                               quant_block, quant_steps, ceiling)
    return rows


def run_rows(name, dname, mask, copy_bw, block_ts, warps, tokens, reg_routes, block_hs,
             ceiling, chain, pdls=(None,), ids=None) -> list[dict]:
    """One config's cases for bf16 rows or FP8 rows (the fp8 bits as uint8 and the fp32
    blockwise scale row as side rows). With ``ids`` (the same routing as an index map),
    also the index-map permute: the sorting map then the scatter (the ops' path) against
    ``permute_index_triton``; their bytes count the ids and the ``[T, 2K+1]`` map."""
    t, h, e, k = CONFIGS[name]
    n = t * k
    default = fused_map_tiling(t, e)
    nb = -(-h // 128)
    rows = []
    inputs = [(torch.randn(t, h, dtype=torch.bfloat16, device="cuda"), None)
              if dname == "bf16" else
              (torch.randint(0, 255, (t, h), dtype=torch.uint8, device="cuda"),
               torch.rand(t, nb, device="cuda")) for _ in range(chain)]
    x, side = inputs[0]
    row = h * x.element_size() + (nb * 4 if side is not None else 0)
    nbytes = (t + n) * row + mask.numel() + rid_bytes(mask)
    rid, fill = make_row_id_map(mask, n, False, 1)
    so = torch.empty(n, nb, device="cuda") if side is not None else None
    cases = {
        "two-step": lambda x, side: two_step(x, mask, n, side, so),
        "scatter alone": lambda x, side: permute_rows(x, rid, n, fill=fill, side=side,
                                                      side_out=so),
        "fused default": lambda x, side: permute_mask_triton(x, mask, n, 1, side=side),
    }
    for bt in block_ts:
        for nw in warps:
            for tp in tokens:
                for rr in reg_routes:
                    for bh, pdl in itertools.product(block_hs or (None,), pdls):
                        til = MapTiling(bt, default.num_warps, default.prefetch)
                        case = f"fused bt={bt} warps={nw} tokens={tp} reg={rr} bh={bh}"
                        cases[case + f" pdl={pdl}"] = (
                            lambda x, side, til=til, nw=nw, tp=tp, rr=rr, bh=bh, pdl=pdl:
                            permute_mask_triton(x, mask, n, 1, side=side, tiling=til,
                                                num_warps=nw, tokens=tp, reg_routes=rr,
                                                block_h=bh, pdl=pdl))
    if ceiling:
        out = x.new_empty(n, h)
        seq = torch.arange(n, device="cuda").view(t, k)
        rnd = torch.randperm(n, device="cuda").view(t, k)
        # one source and destination per chained call, as the op's inputs
        bufs = {id(xi): torch.empty(2, nbytes // 2, dtype=torch.uint8, device="cuda")
                for xi, _ in inputs}
        cases["ceiling: same-bytes copy"] = lambda x, side: bufs[id(x)][1].copy_(bufs[id(x)][0])
        cases["ceiling: K copies, consecutive rows"] = (
            lambda x, side: broadcast(x, seq, out, side, so))
        cases["ceiling: K copies, random rows"] = (
            lambda x, side: broadcast(x, rnd, out, side, so))
    case_bytes = {}
    if ids is not None:
        ibytes = (t + n) * row + ids.numel() * ids.element_size() + t * (2 * k + 1) * 4
        cases["index: sorting map + scatter"] = lambda x, side: index_two_step(
            x, ids, n, side, so)
        for pdl in pdls:
            cases[f"index: fused pdl={pdl}"] = (
                lambda x, side, pdl=pdl: permute_index_triton(x, ids, n, e, side=side, pdl=pdl))
        case_bytes = {c: ibytes for c in cases if c.startswith("index:")}
    for case, fn in cases.items():
        ms = graph_median_ms(chained(fn, inputs)) / chain
        pct = 100 * case_bytes.get(case, nbytes) / (ms * 1e-3) / 1e9 / copy_bw
        rows.append({"config": name, "rows": dname, "case": case, "chain": chain,
                     "graph_ms": round(ms, 4), "pct_copy_bw": round(pct, 1)})
        print(f"{name:>9} {dname} {case:>24} chain={chain}: {ms:8.4f} ms {pct:5.1f}%",
              file=sys.stderr)
    return rows


def index_two_step(x, ids, n, side=None, side_out=None):
    rid, fill = make_row_id_map(ids, n, True, 1)
    return permute_rows(x, rid, n, fill=fill, side=side, side_out=side_out)


def rid_bytes(mask) -> int:
    return mask.shape[0] * (2 * mask.shape[1] + 1) * 4


def map_then_quantize(xb, mask, n, args, **tiling):
    rid, fill = make_row_id_map(mask, n, False, 1)
    return quantize_permute_triton(xb, rid, None, n, *args, fill, **tiling)


def quantize_cases(name, mask, n, copy_bw, tiles, warps, reg_routes,
                   pdls=(None,), block=128, steps=(1,), ceiling=False) -> list[dict]:
    """The fused blockwise quantize-permute of a mask: the map built first, then the
    map-reading kernel (the ops' path for N < 6T), against the kernel that builds the map
    rows itself (N >= 6T), each per row tile (elements a step) x steps a program (0: the
    whole row) x warps, and both kernels at their default tiling. ``block`` 128: blockwise
    (fp32 scales), 32: MXFP8 (e8m0 scales). Bytes: bf16 rows in, fp8 rows and their scales out.
    ``ceiling``: also those bytes with no map and no quantizing: a same-bytes copy, and each
    bf16 row written K times as bytes (its scale row beside it) to rows in a random order."""
    t, h = mask.shape[0], CONFIGS[name][1]
    xb = torch.randn(t, h, dtype=torch.bfloat16, device="cuda")
    mx = block == 32
    recipe = "mx" if mx else "blockwise"
    args = (block, torch.float8_e4m3fn, "mx_floor" if mx else "amax", None)
    nbytes = (t * h * 2 + n * (h + -(-h // block) * (1 if mx else 4)) + mask.numel()
              + rid_bytes(mask))
    cases = {"quantize: map then fused": lambda: map_then_quantize(xb, mask, n, args),
             "quantize: mask fused": lambda: quantize_permute_mask_triton(xb, mask, n, 1, None,
                                                                          *args)}
    if ceiling:
        nb = -(-h // block)
        side = torch.rand(t, nb, device="cuda").to(torch.uint8 if mx else torch.float32)
        out, so = xb.new_empty(n, h, dtype=torch.uint8), side.new_empty(n, nb)
        rnd = torch.randperm(n, device="cuda").view(t, n // t)
        buf = torch.empty(2, nbytes // 2, dtype=torch.uint8, device="cuda")
        cases["ceiling: same-bytes copy"] = lambda: buf[1].copy_(buf[0])
        cases["ceiling: K copies to random rows, bf16 in, bytes out"] = (
            lambda: broadcast(xb, rnd, out, side, so))
    for tile, st, nw in itertools.product(tiles, steps, warps):
        cases[f"quantize: map then fused tile={tile} steps={st} warps={nw}"] = (
            lambda tile=tile, st=st, nw=nw: map_then_quantize(xb, mask, n, args, tile=tile,
                                                              steps=st, num_warps=nw))
        for rr, pdl in itertools.product(reg_routes, pdls):
            cases[f"quantize: mask fused tile={tile} steps={st} warps={nw} reg={rr} "
                  f"pdl={pdl}"] = (
                lambda tile=tile, st=st, nw=nw, rr=rr, pdl=pdl: quantize_permute_mask_triton(
                    xb, mask, n, 1, None, *args, tile=tile, steps=st, num_warps=nw,
                    reg_routes=rr, pdl=pdl))
    rows = []
    for case, fn in cases.items():
        ms = graph_median_ms(fn)
        pct = 100 * nbytes / (ms * 1e-3) / 1e9 / copy_bw
        rows.append({"config": name, "rows": f"bf16->fp8 {recipe}", "case": case,
                     "graph_ms": round(ms, 4), "pct_copy_bw": round(pct, 1)})
        print(f"{name:>9} {recipe} {case:>36}: {ms:8.4f} ms {pct:5.1f}%", file=sys.stderr)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--configs", default="dsv3,qwen3next,qwen3,mixtral,gptoss")
    p.add_argument("--block-t", default="8,16,32")
    p.add_argument("--warps", default="2,4,8")
    p.add_argument("--tokens", default="1", help="tokens per program of the fused kernel")
    p.add_argument("--reg-routes", default="auto",
                   help="comma list of auto/0/1: scatter to the rows held in registers (1) or "
                        "read the stored map row back (0); auto: the launcher's choice")
    p.add_argument("--quant-tiles", default="",
                   help="also the fused blockwise quantize-permute of a mask, per row tile "
                        "(elements a step) x --quant-steps x warps (bytes: bf16 in, fp8 + "
                        "scales out)")
    p.add_argument("--quant-steps", default="1",
                   help="comma list: the --quant-tiles cases' steps a program (0: whole row, "
                        "the launchers' default but for the map-reading kernel at H >= 4096)")
    p.add_argument("--quant-block", type=int, default=128, choices=(128, 32),
                   help="the --quant-tiles cases' scale block: 128 blockwise, 32 MXFP8")
    p.add_argument("--block-h", default="", help="comma list: fused cases at these columns "
                   "a program (default: the launcher's)")
    p.add_argument("--ceiling", action="store_true",
                   help="also a same-bytes copy and the K-copies kernels (no map)")
    p.add_argument("--chain", default="1", help="comma list: calls per graph (distinct inputs)")
    p.add_argument("--rows", default="bf16,fp8",
                   help="row kinds: bf16, fp8 (+ fp32 scales); empty: none (--quant-tiles only)")
    p.add_argument("--index", action="store_true", help="also the index-map permute: "
                   "sorting map + scatter against permute_index_triton")
    p.add_argument("--pdl", default="auto", help="comma list of auto/0/1: the scan and the "
                   "fused kernel as programmatic dependent launches (auto: Hopper or newer)")
    a = p.parse_args()
    kinds = [v for v in a.rows.split(",") if v]
    if set(kinds) - {"bf16", "fp8"}:
        p.error(f"--rows: unknown row kinds {sorted(set(kinds) - {'bf16', 'fp8'})}")
    if not torch.cuda.is_available():
        print("sweep_permute_mask: CUDA not available")
        return
    copy_bw = copy_bandwidth_gbs()
    rows = []
    for name in a.configs.split(","):
        for chain in (int(v) for v in a.chain.split(",")):
            rows += run_config(name, copy_bw, [int(v) for v in a.block_t.split(",")],
                               [int(v) for v in a.warps.split(",")],
                               [int(v) for v in a.tokens.split(",")],
                               [int(v) for v in a.quant_tiles.split(",") if v], a.quant_block,
                               [None if v == "auto" else bool(int(v))
                                for v in a.reg_routes.split(",")],
                               [int(v) for v in a.block_h.split(",") if v], a.ceiling, chain,
                               kinds, [None if v == "auto" else bool(int(v))
                                                   for v in a.pdl.split(",")], a.index,
                               [int(v) for v in a.quant_steps.split(",")])
        write_json(a.out, {"bench": "sweep_permute_mask", "env": env_info(),
                           "copy_GB/s": round(copy_bw, 1), "results": rows})


if __name__ == "__main__":
    main()

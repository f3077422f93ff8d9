"""The sweeps behind qmoe's tuning constants: each times a kernel's tilings (CUDA-graph
medians, % of the measured copy bandwidth) next to the op's path, so docs/benchmarks.md's
tables and the constants in qmoe/ops/ cite one command each:
``python -m benchmarks sweep map|permute|permute_mask|gather|merge_backward|quantize|sort_chunks``.
They need CUDA; without it each says so and returns."""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import triton
import triton.language as tl

import qmoe
from benchmarks.common import (
    CONFIGS,
    auto_bools,
    copy_bandwidth_gbs,
    env_info,
    graph_median_ms,
    int_list,
    kernel_breakdown,
    mask_map,
    needs_cuda,
    variant_recorder,
    write_json,
)
from qmoe.ops.kernels.permute import permute_rows_triton, permute_scatter_kernel, zero_rows_kernel
from qmoe.ops.kernels.permute_index import permute_index_triton
from qmoe.ops.kernels.permute_mask import permute_mask_triton
from qmoe.ops.kernels.quantize_permute import quantize_permute_mask_triton, quantize_permute_triton
from qmoe.ops.kernels.sort_chunks import gather_rows_triton, sort_chunks_triton
from qmoe.ops.kernels.unpermute import (
    _checked_row,
    _merge_add,
    _route,
    check_routes,
    merge_backward_triton,
    unpermute_fp8_kernel,
    unpermute_gather_kernel,
)
from qmoe.ops.launch import assert_options, num_slots
from qmoe.ops.row_id_map import make_row_id_map
from qmoe.ops.sort_chunks import chunk_source_rows
from qmoe.ops.torch_impl import merge_weight_grad
from qmoe.ops.tuning import (
    FusedMaskTiling,
    MaskMapTiling,
    MergeBackwardTiling,
    PermuteIndexTiling,
    QuantizePermuteTiling,
    SortChunksTiling,
    map_tiling,
    scatter_tile,
)
from qmoe.tensors.kernels.quantize import quantize_rows_triton
from qmoe.tensors.layouts import FP8_BLOCK_FP32

# --- sweep map -------------------------------------------------------------------------


def map_config(name: str, breakdown: bool = True, block_ts=(8, 16, 32),
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
    # tokens per block x warps x rows loaded ahead (2, or the whole block) x PDL (auto: the
    # launcher's, off)
    tilings = dict.fromkeys(
        MaskMapTiling(block_t=bt, num_warps=nw, prefetch=min(ahead, bt), pdl=bool(pdl))
        for bt, nw, ahead, pdl in itertools.product(block_ts, warps, aheads, pdls))
    for tiling in tilings:
        ms = graph_median_ms(lambda tiling=tiling: mask_map(mask, n, tiling), rep=60)
        out["map"].append({"block_t": tiling.block_t, "num_warps": tiling.num_warps,
                           "prefetch": tiling.prefetch, "pdl": tiling.pdl, "ms": round(ms, 4)})
        print(f"{name} map {tiling}: {ms:.4f} ms", file=sys.stderr)
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



def map_args(p) -> None:
    p.add_argument("--out", default=None)
    p.add_argument("--configs", default="dsv3,qwen3,qwen3next,mixtral,gptoss,small")
    p.add_argument("--no-breakdown", action="store_true", help="only the map sweep")
    p.add_argument("--block-t", default="8,16,32", help="tokens per block to try")
    p.add_argument("--prefetch", default="2,32", help="rows loaded ahead to try (capped)")
    p.add_argument("--warps", default="auto",
                   help="'auto' (half, map_tiling's, twice) or a list of ints, 'default' "
                        "(map_tiling's) and 'row' (one expert a thread: next_pow2(E) / 32)")
    p.add_argument("--pdl", default="auto", help="comma list of auto/0/1: the scan and the "
                   "map pass as programmatic dependent launches (auto: the launcher's, off)")


def map_main(a) -> None:
    """Where the time of a permute goes, kernel by kernel, and the mask-map tiling sweep.

        python -m benchmarks sweep map [--out results.json] [--configs dsv3,qwen3next]

    1. ``make_row_id_map(mask)``'s launches (``mask_rows_triton``) for each
       ``MaskMapTiling``: tokens per block (``--block-t``, 8 to 32 by default: one row of
       counts per block) x warps (``--warps``: half, the default, twice) x rows the map pass
       loads ahead (``--prefetch``, 2 or all) x PDL (``--pdl``), replayed from a CUDA graph
       (median ms); the best goes in ``best_map`` (``bench permute --map-tiling`` reads
       it).
    2. A kernel-level breakdown (``torch.profiler``, CUDA time per call, averaged over 20
       calls) of: bf16 ``moe_permute`` end to end, the FP8 (blockwise) permute, the fused
       MXFP8 quantize-and-permute and the merge with probs, so the gap between a whole op and
       its main kernel is measured rather than guessed.
    """
    if not needs_cuda("sweep map"):
        return
    rows = []
    for c in a.configs.split(","):  # written after each config: a cut-off run keeps the rest
        rows.append(map_config(c, not a.no_breakdown,
                               [int(v) for v in a.block_t.split(",")],
                               [int(v) for v in a.prefetch.split(",")],
                               a.warps, auto_bools(a.pdl)))
        write_json(a.out, {"bench": "sweep_map", "env": env_info(), "results": rows})


# --- sweep permute ---------------------------------------------------------------------


def permute_config(name: str, copy_bw: float) -> list[dict]:
    rows = []
    t, h, e, k = CONFIGS[name]
    n = t * k
    x = torch.randn(t, h, dtype=torch.bfloat16, device="cuda")
    ids = torch.rand(t, e, device="cuda").argsort(dim=1)[:, :k]
    mask = torch.zeros(t, e, dtype=torch.bool, device="cuda").scatter_(1, ids, True)
    _, rid = qmoe.moe_permute(x, mask, n)
    s = num_slots(rid)
    out = torch.empty(n, h, dtype=x.dtype, device="cuda")
    y = torch.randn(n, h, dtype=x.dtype, device="cuda")
    back = torch.empty(t, h, dtype=x.dtype, device="cuda")
    written = torch.zeros(n, dtype=torch.int8, device="cuda")
    nbytes = (t + n) * h * 2 + rid.numel() * 4
    ms = graph_median_ms(lambda: torch.ops.qmoe.make_row_id_map(mask, n, False, 1))
    rows.append({"config": name, "kernel": "make_row_id_map(mask)", "ms": round(ms, 4)})
    print(name, "make_row_id_map(mask)", f"{ms:.4f} ms", file=sys.stderr)
    def record(kernel, fn, nbytes, **tile):
        ms = graph_median_ms(fn, rep=60)
        pct = 100 * nbytes / (ms * 1e-3) / 1e9 / copy_bw
        rows.append({"config": name, "kernel": kernel, **tile, "ms": round(ms, 4),
                     "pct_copy_bw": round(pct, 1)})
        print(name, kernel, tile, f"{ms:.4f} ms {pct:.1f}%", file=sys.stderr)

    def scatter(src, dst, bh, nw, kb):
        permute_scatter_kernel[(t, triton.cdiv(h, bh))](
            src, dst, rid, src, written, written, src, written, src, written, t, n, h, s, 0, 0,
            0, src.stride(0), 0, 0, 0, HAS_W=False, HAS_P=False, HAS_SIDE=False,
            HAS_FILL=False, KB=kb, BLOCK_H=bh, BLOCK_S=1, num_warps=nw)

    def gather(bh, nw):
        unpermute_gather_kernel[(t, triton.cdiv(h, bh))](
            y, back, rid, y, h, s, n, 0, 1, None, None, HAS_W=False, HAS_GP=False,
            BLOCK_H=bh, BLOCK_P=1, EVICT="", PAIRS=False, num_warps=nw)

    # fp8 rows move as uint8 (1 byte per element): the same kernel on a [T, H] uint8 input.
    xb = x.view(torch.uint8)[:, :h].contiguous()
    outb = torch.empty(n, h, dtype=torch.uint8, device="cuda")
    fbytes = (t + n) * h + rid.numel() * 4
    for src, dst, kernel, nb, bhs in ((xb, outb, "permute_scatter_uint8", fbytes,
                                       (2048, 4096, 8192, 16384)),
                                      (x, out, "permute_scatter", nbytes,
                                       (1024, 2048, 4096, 8192))):
        for bh in bhs:
            for nw in (2, 4, 8):
                for kb in (4, 8):
                    record(kernel, lambda src=src, dst=dst, bh=bh, nw=nw, kb=kb: scatter(
                        src, dst, bh, nw, kb), nb, BLOCK_H=bh, num_warps=nw, KB=kb)
    for bh in (1024, 2048, 4096):
        for nw in (4, 8):
            record("unpermute_gather", lambda bh=bh, nw=nw: gather(bh, nw), nbytes,
                   BLOCK_H=bh, num_warps=nw)
    # the passes around the scatter: the written-flags memset and the zero-rows pass
    record("zeros(N) int8", lambda: torch.zeros(n, dtype=torch.int8, device="cuda"), n)
    record("zero_rows", lambda: zero_rows_kernel[(triton.cdiv(n, 64),)](
        out, written.fill_(1), written, written, n, h, 0, HAS_P=False, HAS_SIDE=False,
        BLOCK_R=64, BLOCK_H=64, BLOCK_S=1, num_warps=4), n)
    # the fused quantize-and-permute (MXFP8: read bf16 once, write fp8 + e8m0 scales)
    qbytes = t * h * 2 + n * h + n * triton.cdiv(h, 32) + rid.numel() * 4
    for tile in (1024, 2048, 4096):
        for nw in (4, 8):
            for kb in (4, 8):
                til = QuantizePermuteTiling(tile=tile, kb=kb, num_warps=nw)
                record("quantize_permute_mxfp8", lambda til=til:
                       quantize_permute_triton(x, rid, None, n, 32, torch.float8_e4m3fn,
                                               "mx_floor", None, tiling=til), qbytes,
                       tile=tile, num_warps=nw, KB=kb)
    return rows



def permute_args(p) -> None:
    p.add_argument("--out", default=None)
    p.add_argument("--configs", default="dsv3,mixtral,gptoss,qwen3")


def permute_main(a) -> None:
    """Sweep the permute-scatter, unpermute-gather and fused quantize-permute tilings
    (CUDA-graph medians on the GPU).

        python -m benchmarks sweep permute [--out sweep.json] [--configs dsv3,qwen3]

    Bytes as in ``bench permute`` (rows read once, written once, plus the row_id_map).
    """
    if not needs_cuda("sweep permute"):
        return
    copy_bw = copy_bandwidth_gbs()
    rows = [r for name in a.configs.split(",") for r in permute_config(name, copy_bw)]
    best = {}
    for r in rows:
        key = f"{r['config']}-{r['kernel']}"
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    write_json(a.out, {"env": env_info(), "copy_bw_gbs": copy_bw, "best": best, "rows": rows})


# --- sweep permute_mask ----------------------------------------------------------------


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
    return permute_rows_triton(x, rid, n, fill=fill, side=side, side_out=side_out), rid


def permute_mask_config(name: str, copy_bw: float, block_ts, warps, tokens=(1,), quant_tiles=(),
               quant_block=128, reg_routes=(None,), block_hs=(), ceiling=False, chain=1,
               kinds=("bf16", "fp8"), pdls=(None,), index=False,
               quant_steps=(1,)) -> list[dict]:
    t, h, e, k = CONFIGS[name]
    n = t * k
    ids = torch.rand(t, e, device="cuda").argsort(dim=1)[:, :k]
    mask = torch.zeros(t, e, dtype=torch.bool, device="cuda").scatter_(1, ids, True)
    rows = []
    for dname in kinds:
        rows += permute_mask_rows(name, dname, mask, copy_bw, block_ts, warps, tokens, reg_routes,
                         block_hs, ceiling, chain, pdls, ids if index else None)
    if quant_tiles:
        rows += quantize_cases(name, mask, n, copy_bw, quant_tiles, warps, reg_routes, pdls,
                               quant_block, quant_steps, ceiling)
    return rows


def permute_mask_rows(name, dname, mask, copy_bw, block_ts, warps, tokens, reg_routes, block_hs,
             ceiling, chain, pdls=(None,), ids=None) -> list[dict]:
    """One config's cases for bf16 rows or FP8 rows (the fp8 bits as uint8 and the fp32
    blockwise scale row as side rows). With ``ids`` (the same routing as an index map),
    also the index-map permute: the sorting map then the scatter (the ops' path) against
    ``permute_index_triton``; their bytes count the ids and the ``[T, 2K+1]`` map."""
    t, h, e, k = CONFIGS[name]
    n = t * k
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
        "scatter alone": lambda x, side: permute_rows_triton(x, rid, n, fill=fill, side=side,
                                                             side_out=so),
        "fused default": lambda x, side: permute_mask_triton(x, mask, n, 1, side=side),
    }
    for bt in block_ts:
        for nw in warps:
            for tp in tokens:
                for rr in reg_routes:
                    for bh, pdl in itertools.product(block_hs or (None,), pdls):
                        til = FusedMaskTiling(block_t=bt, num_warps=nw, tokens=tp,
                                              reg_routes=rr, block_h=bh, pdl=pdl)
                        case = f"fused bt={bt} warps={nw} tokens={tp} reg={rr} bh={bh}"
                        cases[case + f" pdl={pdl}"] = (
                            lambda x, side, til=til: permute_mask_triton(
                                x, mask, n, 1, side=side, tiling=til))
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
                lambda x, side, pdl=pdl: permute_index_triton(
                    x, ids, n, e, side=side, tiling=PermuteIndexTiling(pdl=pdl)))
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
    return permute_rows_triton(x, rid, n, fill=fill, side=side, side_out=side_out)


def rid_bytes(mask) -> int:
    return mask.shape[0] * (2 * mask.shape[1] + 1) * 4


def map_then_quantize(xb, mask, n, args, tiling=None):
    rid, fill = make_row_id_map(mask, n, False, 1)
    return quantize_permute_triton(xb, rid, None, n, *args, fill, tiling)


def quantize_cases(name, mask, n, copy_bw, tiles, warps, reg_routes,
                   pdls=(None,), block=128, steps=(1,), ceiling=False) -> list[dict]:
    """The fused blockwise quantize-permute of a mask: the map built first, then the
    map-reading kernel (the ops' path for N < 6T), against the kernel that builds the map
    rows itself (N >= 6T), each per row tile (elements a step) x steps a program (0: the
    whole row) x warps (``QuantizePermuteTiling``), and both kernels at their default
    tiling. ``block`` 128: blockwise
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
        til = QuantizePermuteTiling(tile=tile, steps=st, num_warps=nw)
        cases[f"quantize: map then fused tile={tile} steps={st} warps={nw}"] = (
            lambda til=til: map_then_quantize(xb, mask, n, args, til))
        for rr, pdl in itertools.product(reg_routes, pdls):
            mtil = QuantizePermuteTiling(tile=tile, steps=st, num_warps=nw, reg_routes=rr,
                                         pdl=pdl)
            cases[f"quantize: mask fused tile={tile} steps={st} warps={nw} reg={rr} "
                  f"pdl={pdl}"] = (
                lambda mtil=mtil: quantize_permute_mask_triton(xb, mask, n, 1, None, *args,
                                                               tiling=mtil))
    rows = []
    for case, fn in cases.items():
        ms = graph_median_ms(fn)
        pct = 100 * nbytes / (ms * 1e-3) / 1e9 / copy_bw
        rows.append({"config": name, "rows": f"bf16->fp8 {recipe}", "case": case,
                     "graph_ms": round(ms, 4), "pct_copy_bw": round(pct, 1)})
        print(f"{name:>9} {recipe} {case:>36}: {ms:8.4f} ms {pct:5.1f}%", file=sys.stderr)
    return rows



def row_kinds(s: str) -> list[str]:
    """``--rows``: a comma list of bf16 and fp8 (empty: none)."""
    kinds = [v for v in s.split(",") if v]
    unknown = sorted(set(kinds) - {"bf16", "fp8"})
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown row kinds {unknown}")
    return kinds


def permute_mask_args(p) -> None:
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
    p.add_argument("--rows", default="bf16,fp8", type=row_kinds,
                   help="row kinds: bf16, fp8 (+ fp32 scales); empty: none (--quant-tiles only)")
    p.add_argument("--index", action="store_true", help="also the index-map permute: "
                   "sorting map + scatter against permute_index_triton")
    p.add_argument("--pdl", default="auto", help="comma list of auto/0/1: the scan and the "
                   "fused kernel as programmatic dependent launches (auto: Hopper or newer)")


def permute_mask_main(a) -> None:
    """Tiling sweep of the mask permute that builds its map in the scatter launch.

        python -m benchmarks sweep permute_mask [--out results.json] [--configs dsv3,qwen3next]

    For each config: ``qmoe::permute_mask``'s kernels (counts, scan, fused map + scatter)
    replayed from a CUDA graph (median ms) for each ``FusedMaskTiling``: count block
    (``--block-t``) x warps of the fused kernel (``--warps``) x tokens per program
    (``--tokens``) x ``--reg-routes`` x ``--block-h`` x ``--pdl``, bf16 rows and FP8
    (uint8) rows; next to them the two-step path (``make_row_id_map`` then the scatter) and
    the scatter alone on a prebuilt map, measured in the same run. % is of the measured copy
    bandwidth, bytes as in ``bench permute``.

    ``--block-h`` adds fused cases at other columns a program; ``--ceiling`` adds what the
    op's bytes cost without a map: a copy of the same bytes, and a kernel that writes each
    row K times (to consecutive rows, and to rows in a random order: the scatter's access
    pattern with its destinations precomputed). ``--chain R`` captures R calls on R distinct
    inputs in one graph and reports the time per call (the graph launch and each call's
    ramp-up shared out: a steady-state rate, next to the single call's). ``--rows fp8``
    skips the bf16 rows.
    """
    if not needs_cuda("sweep permute_mask"):
        return
    copy_bw = copy_bandwidth_gbs()
    rows = []
    for name in a.configs.split(","):
        for chain in (int(v) for v in a.chain.split(",")):
            rows += permute_mask_config(name, copy_bw, [int(v) for v in a.block_t.split(",")],
                                        [int(v) for v in a.warps.split(",")],
                                        [int(v) for v in a.tokens.split(",")],
                                        [int(v) for v in a.quant_tiles.split(",") if v],
                                        a.quant_block, auto_bools(a.reg_routes),
                                        [int(v) for v in a.block_h.split(",") if v], a.ceiling,
                                        chain, a.rows, auto_bools(a.pdl), a.index,
                                        [int(v) for v in a.quant_steps.split(",")])
        write_json(a.out, {"bench": "sweep_permute_mask", "env": env_info(),
                           "copy_GB/s": round(copy_bw, 1), "results": rows})


# --- sweep gather ----------------------------------------------------------------------


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
                           probs.stride(0), probs.shape[1], LAYOUT=FP8_BLOCK_FP32, BS=128,
                           MB=3, BIAS=7,
                           HW_CAST=True, HAS_W=True, BLOCK_H=bh, EVICT=ev, num_warps=nw,
                           **assert_options()),
                       nbytes=fbytes, BLOCK_H=bh, num_warps=nw, evict=ev)
    return []


def gather_config(name: str, copy_bw: float, more: bool = False,
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
    nbytes = (t + n) * h * 2  # rows only, as `bench permute`'s merges
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
    # unpermute_gather_kernel's arguments past the merge's (a permute backward's probs
    # gradient, off here)
    no_gp = {"gpp_ptr": None, "gp_ptr": None, "HAS_GP": False, "BLOCK_P": 1}
    one_route = {"PAIRS": False, **no_gp}
    pairs = {"PAIRS": True, **no_gp}
    cases = [("gather", unpermute_gather_kernel, "", wide, one_route),
             ("gather evict_first", unpermute_gather_kernel, "evict_first", small, one_route),
             ("gather_pairs", unpermute_gather_kernel, "", ((4096, (4, 8)), (8192, (8,))),
              pairs),
             ("gather_pairs evict_first", unpermute_gather_kernel, "evict_first", small,
              pairs)]
    cases += [(f"gather_r R={r} evict_first", gather_r_kernel, "evict_first", small, {"R": r})
              for r in (2, 4)]
    if quick:  # the small evict-first tiles, among them the launcher's (tuning.merge_tile)
        cases = [c for c in cases if c[3] is small]
    if not weighted:  # the merge kernel (two routes a step) against one route a step
        one = ((h, (max(1, min(8, h // 512)),)),) if h & (h - 1) == 0 and h <= 4096 else ()
        cases = [("gather (pairs)", unpermute_gather_kernel, "evict_first",
                  ((512, (1,)), (1024, (2,))), pairs),
                 ("gather (pairs)", unpermute_gather_kernel, "", one, pairs),
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



def gather_args(p) -> None:
    p.add_argument("--out", default=None)
    p.add_argument("--configs", default="dsv3,qwen3")
    p.add_argument("--more", action="store_true",
                   help="also the even-split merge and the FP8 blockwise merge tiles")
    p.add_argument("--unweighted", action="store_true",
                   help="merge without weights (the permute backward): the merge kernel at "
                        "512 columns and at one tile, against one route a step")
    p.add_argument("--quick", action="store_true",
                   help="only the small evict-first tiles (the forms that won)")


def gather_main(a) -> None:
    """Sweep the merge (unpermute gather) kernel: tile x warps x pipeline stages x cache
    hint, and a two-routes-a-step variant, next to the whole ``moe_unpermute`` op (CUDA-graph
    medians); ``--more`` adds an even split of H over the column programs and the FP8 merge.
    The weighted merge's backward has a sweep of its own, ``sweep merge_backward``.
    Results: docs/benchmarks.md, "bf16 merge tiles (`merge_tile`)" and "FP8 merge
    (`fp8_merge_tile`; no load-ahead)".

        python -m benchmarks sweep gather [--out sweep_gather.json] [--configs dsv3,qwen3]

    Bytes as in ``bench permute``'s "unpermute(merging_probs)": N rows read, T rows written.
    The variant kernels live in benchmarks/sweeps.py; the two-routes-a-step form
    ("gather_pairs") is ``unpermute_gather_kernel``'s PAIRS. Each sums the same rows in the
    same order (bit-identical, checked in the run).
    """
    if not needs_cuda("sweep gather"):
        return
    copy_bw = copy_bandwidth_gbs()
    rows = [r for name in a.configs.split(",")
            for r in gather_config(name, copy_bw, a.more, a.quick, not a.unweighted)]
    best = {}
    for r in rows:
        key = f"{r['config']}-{r['kernel']}"
        if "ms" in r and (key not in best or r["ms"] < best[key]["ms"]):
            best[key] = r
    write_json(a.out, {"env": env_info(), "copy_bw_gbs": copy_bw, "best": best, "rows": rows})


# --- sweep merge_backward --------------------------------------------------------------


def merge_backward_config(name, copy_bw, kbs, bhs, warps) -> list[dict]:
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

    ref_gi, ref_gw = permute_rows_triton(g, rid, n, probs), merge_weight_grad(g, y, rid, e)
    for kb in kbs:
        for bh in bhs:
            for nw in warps:
                til = MergeBackwardTiling(kb=kb, block_h=bh, num_warps=nw)
                gi, gw = merge_backward_triton(g, y, rid, probs, til)
                assert torch.equal(gi, ref_gi), (name, til)
                torch.testing.assert_close(gw, ref_gw, rtol=1e-5, atol=1e-3)
                record(f"one pass kb {kb} bh {bh} warps {nw}",
                       lambda til=til: merge_backward_triton(g, y, rid, probs, til))
    record("one pass, merge_backward_tile's tiling",
           lambda: merge_backward_triton(g, y, rid, probs))
    return rows



def merge_backward_args(p) -> None:
    p.add_argument("--out")
    p.add_argument("--configs", default="dsv3,qwen3,qwen3next,mixtral,gptoss")
    p.add_argument("--kb", default="2,4")
    p.add_argument("--block-h", default="1024,2048")
    p.add_argument("--warps", default="4,8")


def merge_backward_main(a) -> None:
    """Sweep the weighted merge's backward in one pass (``merge_backward_triton``: routes a
    step x columns a tile x warps: ``MergeBackwardTiling``), the tilings
    ``tuning.merge_backward_tile`` chooses from.
    CUDA-graph medians, % of copy bandwidth. Results, with the two-kernel form as a reference
    (a weighted scatter of the gradient, then a weight-gradient kernel into a zeroed fp32
    [T, P], then a cast): docs/benchmarks.md, "Merge backward (`merge_backward_tile`)".

        python -m benchmarks sweep merge_backward [--out F] [--configs dsv3,mixtral]
            [--kb 2,4] [--block-h 1024,2048] [--warps 4,8]

    Bytes as ``bench permute``'s "unpermute backward(probs)": T gradient rows and N input
    rows read, N rows written. Each variant's grad_inp is checked bit-exact against the
    weighted scatter's (``permute_rows_triton``), and its weights' gradient against fp32 torch dot
    products, before it is timed.
    """
    if not needs_cuda("sweep merge_backward"):
        return
    copy_bw = copy_bandwidth_gbs()
    rows = []
    for name in a.configs.split(","):
        rows += merge_backward_config(name, copy_bw, int_list(a.kb), int_list(a.block_h),
                                      int_list(a.warps))
    write_json(a.out, {"bench": "sweep_merge_backward", "env": env_info(),
                       "copy_bw_gbs": round(copy_bw, 1), "args": vars(a), "results": rows})


# --- sweep quantize --------------------------------------------------------------------


def quantize_args(p) -> None:
    p.add_argument("--kinds", default="blocks,rows,cols",
                   help="blocks: 1x128 and 1x32 blocks at dsv3 and gptoss widths; rows: one "
                        "block a row (RowWise, grouped_mm's gradients and weights)")
    p.add_argument("--out", default=None)


# (tokens, width, scale mode, block) swept by `sweep quantize`, by kind
_QUANTIZE_SWEEP = {
    "blocks": [(16384, 7168, "amax", 128), (16384, 7168, "mx_floor", 32),
               (16384, 2880, "amax", 128), (16384, 2880, "mx_floor", 32)],
    "rows": [(32768, 7168, "amax", 8192), (32768, 4096, "amax", 4096),
             (32768, 2048, "amax", 2048), (65536, 1536, "amax", 2048)],
}


def _sweep_quantize_cols(copy_bw: float) -> list[dict]:
    """``quantize_cols_kernel`` (grouped_mm's weights per output column, written
    transposed) at the expert weights of ``bench grouped_mm``'s shapes; % of copy counts
    its 5 bytes an element (bf16 read twice, e4m3 written)."""
    from qmoe.ops.kernels.grouped_mm import quantize_cols_triton

    rows = []
    for e, k, m in [(32, 7168, 4096), (32, 2048, 7168), (128, 4096, 3072), (128, 1536, 4096)]:
        w = torch.randn(e, k, m, dtype=torch.bfloat16, device="cuda")
        nbytes = 5 * w.numel() + 4 * e * m
        for tile in [(bk, bm, nw) for bk in (64, 128, 256) for bm in (16, 32, 64, 128)
                     for nw in (4, 8)]:
            ms = graph_median_ms(lambda tile=tile, w=w: quantize_cols_triton(w, tiling=tile))
            pct = 100 * nbytes / (ms * 1e-3) / 1e9 / copy_bw
            rows.append({"T": e * k, "H": m, "mode": "cols", "block": k, "tile": tile,
                         "ms": round(ms, 4), "pct_copy_bw": round(pct, 1)})
            print("cols", e, k, m, tile, f"{ms:.4f} ms {pct:.1f}%", file=sys.stderr)
        del w
    return rows


def quantize_main(a) -> None:
    """Sweep the quantize kernel's tiling on the GPU (CUDA-graph medians) to pick defaults
    (``qmoe.tensors.tuning.quantize_rows_tile``).

        python -m benchmarks sweep quantize [--kinds blocks,rows,cols] [--out sweep.json]
    """
    if not needs_cuda("sweep quantize"):
        return
    copy_bw = copy_bandwidth_gbs()
    rows = []
    for kind in a.kinds.split(","):
        for t, h, mode, bs in _QUANTIZE_SWEEP.get(kind, ()):
            x = torch.randn(t, h, dtype=torch.bfloat16, device="cuda")
            nbytes = x.numel() * 3 + t * -(-h // bs) * (4 if mode == "amax" else 1)
            for block_r in (1, 2, 4, 8, 16, 32):
                for groups in (1, 2, 4, 8, 16):
                    if block_r * groups * bs not in (2048, 4096, 8192, 16384) or (
                            groups > 1 and bs >= h):
                        continue
                    for nw in (4, 8, 16) if bs >= 2048 else (4, 8):
                        tile = (block_r, groups, nw)
                        ms = graph_median_ms(
                            lambda tile=tile, x=x, mode=mode, bs=bs: quantize_rows_triton(
                                x, bs, torch.float8_e4m3fn, mode, tiling=tile))
                        pct = 100 * nbytes / (ms * 1e-3) / 1e9 / copy_bw
                        rows.append({"T": t, "H": h, "mode": mode, "block": bs,
                                     "tile": tile, "ms": round(ms, 4),
                                     "pct_copy_bw": round(pct, 1)})
                        print(t, h, mode, bs, tile, f"{ms:.4f} ms {pct:.1f}%",
                              file=sys.stderr)
            del x
    if "cols" in a.kinds.split(","):
        rows += _sweep_quantize_cols(copy_bw)
    best = {}
    for r in rows:
        k = f"{r['T']}x{r['H']}-{r['mode']}-{r['block']}"
        if k not in best or r["ms"] < best[k]["ms"]:
            best[k] = r
    write_json(a.out, {"bench": "sweep_quantize", "env": env_info(), "copy_GB/s": copy_bw,
                       "best": best, "results": rows})


# --- sweep sort_chunks -----------------------------------------------------------------


def sort_chunks_config(name, copy_bw, block_hs, steps_list, warps, random_sizes) -> list[dict]:
    t, h, e, k = CONFIGS[name]
    n = t * k
    y = torch.randn(n, h, dtype=torch.bfloat16, device="cuda")
    if random_sizes:
        cuts = torch.sort(torch.randint(0, n + 1, (e - 1,))).values
        sizes = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([n])])).cuda()
    else:
        sizes = torch.full((e,), n // e, device="cuda")
    order = torch.randperm(e, device="cuda")
    nbytes = 2 * n * h * 2
    ref = gather_rows_triton(y, chunk_source_rows(sizes, order, n))
    rows = []
    record = variant_recorder(rows, name, nbytes, copy_bw, 40)

    record("op path (source rows + gather)",
           lambda: gather_rows_triton(y, chunk_source_rows(sizes, order, n)))
    out = torch.empty_like(y)
    for bh in block_hs:
        for st in steps_list:
            for nw in warps:
                til = SortChunksTiling(block_h=bh, steps=st, num_warps=nw)
                got, _ = sort_chunks_triton(y, sizes, order, tiling=til, out=out)
                assert torch.equal(got, ref), (name, bh, st, nw)
                back, _ = sort_chunks_triton(got, sizes, order, inverse=True, check=False,
                                             tiling=til)
                assert torch.equal(back, y), (name, bh, st, nw, "inverse")
                record(f"bh {bh} steps {st} warps {nw}",
                       lambda til=til: sort_chunks_triton(y, sizes, order, tiling=til, out=out))
                record(f"  inverse bh {bh} steps {st} warps {nw}",
                       lambda til=til: sort_chunks_triton(
                           ref, sizes, order, inverse=True, check=False, tiling=til, out=out))
    record("launcher's default tiling", lambda: sort_chunks_triton(y, sizes, order, out=out))
    return rows


def sort_chunks_scales(name, copy_bw) -> list[dict]:
    """The sort of FP8 scale rows (blockwise fp32 1x128, MX e8m0 1x32: 16-224 bytes a row),
    the case ``MAX_SCAN_ELEMENTS`` cuts tiles for (docs/benchmarks.md, "FP8 rows: int32
    words, the scan cut, side rows"): the gather path, the kernel in byte lanes with uncut
    tiles, and with the int32 words and the cut tiles each alone and together."""
    import qmoe

    t, h, e, k = CONFIGS[name]
    n = t * k
    y = torch.randn(n, h, dtype=torch.bfloat16, device="cuda")
    sizes = torch.full((e,), n // e, device="cuda")
    order = torch.randperm(e, device="cuda")
    rows = []
    for rname, recipe in (("blockwise", qmoe.Blockwise()), ("mx", qmoe.MXFP8())):
        sc = qmoe.quantize(y, recipe).raw_scale
        nbytes = 2 * sc.numel() * sc.element_size()
        record = variant_recorder(rows, name, nbytes, copy_bw, 40)
        ref = gather_rows_triton(sc, chunk_source_rows(sizes, order, n))
        record(f"{rname} scales: gather path", lambda sc=sc: gather_rows_triton(
            sc, chunk_source_rows(sizes, order, n)))
        out = torch.empty_like(sc)
        for words, max_scan in ((False, 1 << 30), (True, 1 << 30), (False, None), (True, None)):
            kw = dict(tiling=SortChunksTiling(words=words, max_scan=max_scan), out=out)
            assert torch.equal(sort_chunks_triton(sc, sizes, order, **kw)[0], ref)
            label = ("words" if words else "bytes") + (", cut" if max_scan is None else "")
            record(f"{rname} scales: kernel, {label}",
                   lambda sc=sc, kw=kw: sort_chunks_triton(sc, sizes, order, **kw))
    return rows


def sort_chunks_fp8(name, copy_bw, steps_list) -> list[dict]:
    """The sort of FP8 rows (uint8 bits) with their scale rows as side rows, per recipe:
    two launches (bits, then scales) against one launch, bytes or int32 words, ``steps``
    row tiles a program, the side tiles in the rows' layout (``side_wide``), byte side
    rows as int32 words (``side_words``, MX), and the launcher's default. Bytes: bits and
    scale rows, read once, written once. Results: docs/benchmarks.md, "FP8 rows: int32
    words, the scan cut, side rows" (which also gives side rows in a column program of
    their own: 10-35 points slower, so the kernel has no such form)."""
    import qmoe

    t, h, e, k = CONFIGS[name]
    n = t * k
    y = torch.randn(n, h, dtype=torch.bfloat16, device="cuda")
    sizes = torch.full((e,), n // e, device="cuda")
    order = torch.randperm(e, device="cuda")
    src = chunk_source_rows(sizes, order, n)
    rows = []
    for rname, recipe in (("blockwise", qmoe.Blockwise()), ("mx", qmoe.MXFP8()),
                          ("pertensor", qmoe.PerTensor())):
        q = qmoe.quantize(y, recipe)
        bits = q.qdata.view(torch.uint8)
        sc = q.raw_scale if q.raw_scale.dim() == 2 else None
        nbytes = 2 * (bits.numel() + (sc.numel() * sc.element_size() if sc is not None else 0))
        record = variant_recorder(rows, name, nbytes, copy_bw, 40)
        ref = gather_rows_triton(bits, src)
        out = torch.empty_like(bits)
        if sc is not None:
            ref_s = gather_rows_triton(sc, src)
            so = torch.empty_like(sc)
            record(f"{rname}: two launches", lambda bits=bits, sc=sc, out=out, so=so: (
                sort_chunks_triton(bits, sizes, order, out=out),
                sort_chunks_triton(sc, sizes, order, out=so)))
        # (words, steps, side_wide, side_words); None: the launcher's rule. (True, None,
        # None, None) is its default; side_wide=True only where there are side rows,
        # side_words only where they are bytes (MX)
        variants = [(w, st, False, False) for w in (False, True) for st in steps_list]
        variants.append((True, None, None, None))
        if sc is not None:
            extra = [None] if sc.element_size() != 1 else []  # (MX: in the next list)
            variants += [(True, st, True, False) for st in steps_list + extra]
        if sc is not None and sc.element_size() == 1:
            variants += [(True, None, wide, sw) for wide in (False, True, None)
                         for sw in (False, True)]
        for words, st, wide, sw in variants:
            til = SortChunksTiling(steps=st, words=words, side_wide=wide,
                                   side_words=True if sw is None else sw)
            kw = dict(tiling=til, out=out)
            if sc is not None:
                so.fill_(float("nan") if so.is_floating_point() else 0xFF)
                kw.update(side=sc, side_out=so)
            out.fill_(0xFF)
            got, _ = sort_chunks_triton(bits, sizes, order, **kw)
            assert torch.equal(got, ref), (name, rname, words, st, wide, sw)
            if sc is not None:
                assert torch.equal(so, ref_s), (name, rname, words, st, wide, sw, "side")
            if st is None and wide is None and sw is None:
                label = "default"
            elif st is None and sc is not None and sc.element_size() == 1:
                label = (f"default steps, side {'words' if sw else 'bytes'}"
                         + {False: ", narrow", True: ", wide", None: ""}[wide])
            else:
                label = ("default steps" if st is None
                         else f"{'words' if words else 'bytes'}, steps {st}")
                label += ", side wide" if wide else ", side narrow" if sc is not None else ""
            record(f"{rname}: one launch, {label}",
                   lambda bits=bits, kw=kw: sort_chunks_triton(bits, sizes, order, **kw))
    return rows



def sort_chunks_args(p) -> None:
    p.add_argument("--out")
    p.add_argument("--configs", default="dsv3,qwen3,qwen3next,mixtral,gptoss,small")
    p.add_argument("--block-h", default="1024,4096,8192")
    p.add_argument("--steps", default="1,4")
    p.add_argument("--warps", default="8")
    p.add_argument("--random-sizes", action="store_true")
    p.add_argument("--scales", action="store_true",
                   help="only the FP8 scale rows' sort: gather path vs kernel variants")
    p.add_argument("--fp8", action="store_true",
                   help="FP8 rows with their scale rows: two launches vs one "
                        "(sort_chunks_fp8)")


def sort_chunks_main(a) -> None:
    """Sweep the one-launch chunk sort (``sort_chunks_triton``): columns a tile x row tiles a
    program x warps (``SortChunksTiling``), forward and inverse (the backward), next to the
    op's gather path (``chunk_source_rows`` + ``gather_rows_triton``). CUDA-graph medians, %
    of copy bandwidth.

        python -m benchmarks sweep sort_chunks [--out F] [--configs dsv3,qwen3]
            [--block-h 1024,4096,8192] [--steps 1,4] [--warps 4,8] [--random-sizes]
            [--scales] [--fp8]

    ``--scales`` times only the sort of FP8 scale rows (``sort_chunks_scales``); ``--fp8``
    FP8 rows with their scale rows, in one launch or two (``sort_chunks_fp8``). Chunks: E of
    them (an EP rank's received chunks, one per expert), N = T*K rows; sizes N/E each, or
    with ``--random-sizes`` a random split of N (zero-size chunks included). Bytes: N rows
    read and N rows written. Every variant's output is checked bit-exact against the gather
    path's before it is timed.
    """
    if not needs_cuda("sweep sort_chunks"):
        return
    copy_bw = copy_bandwidth_gbs()
    rows = []
    for name in a.configs.split(","):
        if a.scales:
            rows += sort_chunks_scales(name, copy_bw)
            continue
        if a.fp8:
            rows += sort_chunks_fp8(name, copy_bw, int_list(a.steps))
            continue
        rows += sort_chunks_config(name, copy_bw, int_list(a.block_h), int_list(a.steps),
                                   int_list(a.warps), a.random_sizes)
    write_json(a.out, {"bench": "sweep_sort_chunks", "env": env_info(),
                       "copy_bw_gbs": round(copy_bw, 1), "args": vars(a), "results": rows})


COMMANDS = {  # name: (add its options to a parser, run it on the parsed options)
    "map": (map_args, map_main),
    "permute": (permute_args, permute_main),
    "permute_mask": (permute_mask_args, permute_mask_main),
    "gather": (gather_args, gather_main),
    "merge_backward": (merge_backward_args, merge_backward_main),
    "quantize": (quantize_args, quantize_main),
    "sort_chunks": (sort_chunks_args, sort_chunks_main),
}

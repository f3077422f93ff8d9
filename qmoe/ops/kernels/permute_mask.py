"""Triton code of the mask permute that builds its map rows in the scatter launch
and its launcher ``permute_mask_triton`` (the CUDA kernel of ``qmoe::permute_mask``).

Glossary: T tokens, E experts, H hidden, N output rows, NS side-row columns (block scales),
BLOCK_T tokens per block of the count pass (one row of per-expert counts), BLOCK_E =
next_pow2(E), A the padding alignment, Z programs sharing the tail of unwritten rows.

The map's row of token t needs only each expert's total, the tokens of earlier blocks
(``mask_block_counts_kernel`` + ``block_scan_kernel``, or counted by the program itself
when SMALL) and the rows of t's own block before it, so every program builds the map rows
of its TOKENS tokens (a running count per expert from one to the next), stores them, and
moves each data row to the rows it holds in registers (no read back of the stored row).
The map rows' scans overlap the other programs' copies, and the data rows are loaded
first, so their reads are in flight during them. With PDL (Hopper's programmatic dependent
launch) the kernel launches while the scan still runs: the programs load their data rows,
then wait for the scan's end (``gdc_wait``) before reading the counts. The programs after
the token programs zero the rows no route writes.
"""

from __future__ import annotations

import functools
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from qmoe._intmath import cdiv, next_pow2
from qmoe._triton import launch
from qmoe.ops.kernels.permute import _scatter_token, _tail_share, store_routes, zero_rows
from qmoe.ops.kernels.row_id_map import (
    block_counts,
    count_mask,
    expert_starts,
    mask_row,
    write_map_row,
)
from qmoe.ops.launch import assert_options, mask_operand, pdl_default, pdl_options, unit_stride
from qmoe.ops.tuning import (
    FUSED_TOKENS,
    FUSED_WARPS,
    FusedMaskTiling,
    count_chunk,
    fused_map_tiling,
    reg_routes_flag,
    scatter_tile,
    small_map,
    tail_programs,
)

#: no overrides: the defaults (frozen, so one instance serves every call)
_DEFAULTS = FusedMaskTiling()


@triton.jit
def permute_mask_kernel(
    inp_ptr,  # (T, H) any dtype, row stride stride_in
    out_ptr,  # (N, H) same dtype, contiguous
    mask_ptr,  # (T, E) any integer dtype (bool as uint8), nonzero = routed, row stride stride_m
    before_ptr,  # (cdiv(T, BLOCK_T), E) int32: tokens of earlier blocks (unless SMALL)
    total_ptr,  # (E,) int32: tokens per expert (unless SMALL)
    map_ptr,  # (T, 2E+1) int32 out: the row_id_map
    p_ptr,  # (T, E) float probs, row stride stride_p (read only if HAS_P)
    pp_ptr,  # (N,) probs dtype out: the permuted probs (written only if HAS_P)
    side_ptr,  # (T, NS) side rows moved with the data, row stride stride_side (if HAS_SIDE)
    side_out_ptr,  # (N, NS) side rows out, contiguous (written only if HAS_SIDE)
    T,
    N,
    H,
    E,
    NS,
    A,
    Z,
    stride_in,
    stride_m,
    stride_p,
    stride_side,
    HAS_P: tl.constexpr,
    HAS_SIDE: tl.constexpr,
    SMALL: tl.constexpr,  # count the whole mask in every program (no count/scan launches)
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK_T: tl.constexpr,  # mask rows per step of SMALL's counting walk
    KB: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
    TOKENS: tl.constexpr,  # tokens per program (divides BLOCK_T unless SMALL)
    REG_ROUTES: tl.constexpr,  # scatter to the rows held in registers (else: read back)
    PDL: tl.constexpr,  # launched as a programmatic dependent of the scan (not SMALL)
):
    """Grid ``(cdiv(T, TOKENS) + R - 1 + Z, cdiv(H, BLOCK_H))`` with R = E + 1 ranges of
    unwritten rows when A > 1 (each expert's padding, then the tail), else R = 1 (the
    tail). Every column-block program of a token writes the same map row (a benign
    duplicate)."""
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = cols < H
    progs = tl.cdiv(T, TOKENS)
    if pid < progs:
        t0 = pid * TOKENS
        xs = ()  # the rows load first: in flight during the map work
        for i in tl.static_range(TOKENS):
            t = (t0 + i).to(tl.int64)
            width = tl.where(t < T, H, 0)  # past T: nothing to load
            xs = xs + (tl.load(inp_ptr + t * stride_in + cols, mask=cols < width),)
        if PDL:  # the scan's counts are read from here on
            tl.extra.cuda.gdc_wait()
        run = next_rows(t0, mask_ptr, before_ptr, total_ptr, T, E, A, stride_m, SMALL, BLOCK_T,
                        BLOCK_E, CHUNK_T)
        for i in tl.static_range(TOKENS):
            t = t0 + i
            keep, slot, n, mi = map_token(t, run, mask_ptr, map_ptr, T, N, E, stride_m, BLOCK_E)
            if REG_ROUTES:  # the rows come from registers
                for s0 in range(0, n, KB):
                    d, c, smask = routes_at(keep, slot, run, s0, n, BLOCK_E, KB)
                    store_routes(t.to(tl.int64), xs[i], d, c, smask, out_ptr, None, None,
                                 p_ptr, pp_ptr, side_ptr, side_out_ptr, NS, H, cols, hmask, 0,
                                 stride_p, stride_side, False, HAS_P, HAS_SIDE, False, KB,
                                 BLOCK_H, BLOCK_S)
            elif t < T:  # from the stored map row, read back after a barrier
                tl.debug_barrier()
                _scatter_token(t.to(tl.int64), xs[i], out_ptr, map_ptr, None, None, p_ptr,
                               pp_ptr, side_ptr, side_out_ptr, N, E, NS, H, cols, hmask, 0,
                               stride_p, stride_side, False, HAS_P, HAS_SIDE, False, KB,
                               BLOCK_H, BLOCK_S)
            run += mi
    else:
        if PDL:
            tl.extra.cuda.gdc_wait()
        lo, hi = unwritten_range(pid - progs, mask_ptr, total_ptr, T, N, E, A, Z, stride_m,
                                 SMALL, BLOCK_E, CHUNK_T)
        sc = tl.arange(0, BLOCK_S)
        first = tl.program_id(1) == 0
        zero_rows(lo, hi, N, out_ptr, H, cols, hmask, side_out_ptr, NS, sc,
                  sc < tl.where(first, NS, 0), pp_ptr, first, HAS_SIDE, HAS_P)


@triton.jit
def next_rows(t0, mask_ptr, before_ptr, total_ptr, T, E, A, stride_m, SMALL: tl.constexpr,
              BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK_T: tl.constexpr):
    """``[BLOCK_E]`` int32: each expert's output row for token ``t0`` (its start plus its
    tokens before t0; arguments as in ``permute_mask_kernel``)."""
    ce = tl.arange(0, BLOCK_E)
    emask = ce < E
    if SMALL:
        total, before = count_mask(mask_ptr, T, E, stride_m, t0, ce, CHUNK_T)
    else:
        blk = t0 // BLOCK_T
        total = tl.load(total_ptr + ce, mask=emask, other=0)
        before = tl.load(before_ptr + blk.to(tl.int64) * E + ce, mask=emask, other=0)
        for i in tl.static_range(BLOCK_T - 1):  # the block's rows before t0
            before += mask_row(mask_ptr, blk * BLOCK_T + i, t0, E, stride_m, ce)
    start, _ = expert_starts(total, A)
    return start + before


@triton.jit
def map_token(t, run, mask_ptr, map_ptr, T, N, E, stride_m, BLOCK_E: tl.constexpr):
    """Store token t's map row (if t < T) from ``run`` (``next_rows``) and return it in
    registers: ``(keep, slot, n, mi)``: ``[BLOCK_E]`` vectors over the experts (routed and
    kept; position among the kept routes), the count of kept routes, and the token's mask
    row (0/1, zero past T: add it to ``run`` for the next token). The program never reads
    the stored row back (no barrier, no second memory round trip before its stores)."""
    ce = tl.arange(0, BLOCK_E)
    mi = mask_row(mask_ptr, t, T, E, stride_m, ce)
    keep = (mi != 0) & (run < N)
    ki = keep.to(tl.int32)
    slot = tl.cumsum(ki, axis=0) - ki  # position among the token's kept routes
    n = tl.sum(ki, axis=0)
    if t < T:
        write_map_row(map_ptr + t.to(tl.int64) * (2 * E + 1), E, ce, ce < E, slot, run, ce,
                      keep, n, tl.full((BLOCK_E,), -1, dtype=tl.int32))
    return keep, slot, n, mi


@triton.jit
def routes_at(keep, slot, run, s0, n, BLOCK_E: tl.constexpr, KB: tl.constexpr):
    """``(rows int64, experts int32, mask)``, ``[KB]`` each: the token's kept routes
    ``s0 .. s0+KB-1`` (in slot order, as its map row lists them), picked out of the
    ``[BLOCK_E]`` vectors of ``map_token`` (one masked sum across the experts)."""
    sl = s0 + tl.arange(0, KB)
    hit = keep[None, :] & (slot[None, :] == sl[:, None])  # (KB, BLOCK_E)
    rows = tl.sum(tl.where(hit, run[None, :], 0), axis=1)
    experts = tl.sum(tl.where(hit, tl.arange(0, BLOCK_E)[None, :], 0), axis=1)
    return rows.to(tl.int64), experts, sl < n


@triton.jit
def unwritten_range(g, mask_ptr, total_ptr, T, N, E, A, Z, stride_m, SMALL: tl.constexpr,
                    BLOCK_E: tl.constexpr, CHUNK_T: tl.constexpr):
    """``(lo, hi)``: the rows no route writes that fill program ``g`` zeroes (``g`` in
    ``[0, R - 1 + Z)``): ranges ``0..E-1`` are the experts' padding when A > 1, the tail
    past the (padded) total is split over the last Z programs."""
    ce = tl.arange(0, BLOCK_E)
    if SMALL:
        total, _ = count_mask(mask_ptr, T, E, stride_m, 0, ce, CHUNK_T)
    else:
        total = tl.load(total_ptr + ce, mask=ce < E, other=0)
    start, padded = expert_starts(total, A)
    ranges = tl.where(A > 1, E, 0)  # padded maps: one range per expert before the tail
    if g < ranges:
        lo = tl.sum(tl.where(ce == g, start + total, 0), axis=0)
        hi = tl.sum(tl.where(ce == g, start + padded, 0), axis=0)
    else:
        lo, hi = _tail_share(tl.minimum(tl.sum(padded, axis=0), N), N, g - ranges, Z)
    return lo, hi


# ------------------------------------------------------------------------- launchers


def permute_mask_triton(
    x: torch.Tensor,
    mask: torch.Tensor,
    n: int,
    align_size: int,
    probs: torch.Tensor | None = None,
    side: torch.Tensor | None = None,
    tiling: FusedMaskTiling | None = None,
    *,
    out: torch.Tensor | None = None,
):
    """``(out [N, H], permuted_probs [N] or None, side_out [N, NS] or None, row_id_map
    [T, 2E+1] int32)`` of ``x [T, H]`` by ``mask [T, E]`` with ``probs [T, E]`` and side
    rows ``[T, NS]`` moved alike, each expert's group padded to ``align_size``: as
    ``make_row_id_map`` then the scatter, bit for bit. Launches: the per-block counts and
    their scan (as programmatic dependents on Hopper: ``launch.pdl_default``), then the
    fused kernel; one launch for masks of at most ``SMALL_MAP_BYTES``. ``tiling``
    overrides the defaults (``FusedMaskTiling``); ``out`` (tests: poisoned) receives the
    rows. No host sync."""
    o = tiling or _DEFAULTS
    t, h = x.shape
    e = mask.shape[1]
    out, pp, so, rid = outputs = fused_outputs(x, mask, n, probs, side, out)
    if t == 0 or e == 0:
        return no_routes(outputs)
    ns = so.shape[1] if side is not None else 0
    m = mask_operand(mask)
    x, probs, side = unit_stride(x), unit_stride(probs), unit_stride(side)
    has_p, has_s = probs is not None, side is not None
    grid, small, bt, map_warps, pdl, options = _mask_plan(
        t, h, e, n, align_size, x.element_size(), m.element_size(), has_p, has_s, ns, o,
        o.pdl if o.pdl is not None else pdl_default(x))
    before, total = (None, None) if small else block_counts(m, bt, map_warps, pdl)
    launch(permute_mask_kernel, grid,
        x, out, m, before, total, rid, probs, pp, side, so, t, n, h, e, ns,
        max(align_size, 1), tail_programs(n),
        x.stride(0), m.stride(0), probs.stride(0) if has_p else None,
        side.stride(0) if has_s else None, **options,
    )
    return out, pp, so, rid


@functools.lru_cache(maxsize=1024)
def _mask_plan(t, h, e, n, align_size, x_size, m_size, has_p, has_s, ns, o, pdl_ok):
    """``(grid, SMALL, count block, count warps, PDL, launch options)`` of
    ``permute_mask_kernel`` for these sizes and overrides ``o`` (``pdl_ok``: PDL allowed
    here): pure in its arguments, so kept per process (no data; the options read-only)."""
    be = next_pow2(e)
    d = fused_map_tiling(t, e)
    bt, map_warps = o.block_t or d.block_t, o.map_warps or d.num_warps
    bh, _, kb = scatter_tile(h, x_size, False)
    bh = o.block_h or bh
    nw = o.num_warps or FUSED_WARPS
    small = o.one_launch if o.one_launch is not None else small_map(t, e, m_size)
    pdl = not small and pdl_ok
    ranges = e if align_size > 1 else 0
    tokens = o.tokens or FUSED_TOKENS
    if not small and bt % tokens:
        raise ValueError(f"tokens per program ({tokens}) must divide the count block ({bt})")
    grid = (cdiv(t, tokens) + ranges + tail_programs(n), cdiv(max(h, 1), bh))
    options = MappingProxyType(dict(
        HAS_P=has_p, HAS_SIDE=has_s, SMALL=small, BLOCK_T=bt, BLOCK_E=be,
        CHUNK_T=count_chunk(t, be, nw), KB=kb, BLOCK_H=bh,
        BLOCK_S=next_pow2(max(ns, 1)), TOKENS=tokens,
        REG_ROUTES=reg_routes_flag(be, o.reg_routes), PDL=pdl, num_warps=nw,
        **pdl_options(pdl), **assert_options(),  # assert_probs_not_nan
    ))
    return grid, small, bt, map_warps, pdl, options


def fused_outputs(x, routing_map, n, probs, side, out=None):
    """``(out [N, H] (the given ``out``, else new), permuted probs [N] or None, side rows
    [N, NS] or None, row_id_map [T, 2S+1] int32)``, unwritten, for a fused permute
    launcher of ``x [T, H]`` by ``routing_map [T, S]``: None without probs, without side
    rows (the ops' optional outputs: no tensor is made for what the call does not give)."""
    t, s = routing_map.shape
    dev = x.device  # torch.empty: about half the host time of new_empty on CUDA
    rid = torch.empty((t, 2 * s + 1), dtype=torch.int32, device=dev)
    out = torch.empty((n, x.shape[1]), dtype=x.dtype, device=dev) if out is None else out
    pp = torch.empty((n,), dtype=probs.dtype, device=dev) if probs is not None else None
    so = (torch.empty((n, side.shape[1]), dtype=side.dtype, device=dev) if side is not None
          else None)
    return out, pp, so, rid


def no_routes(outputs):
    """``fused_outputs`` filled for a call without routes (no tokens or no slots): every
    row zero, every map row empty."""
    out, pp, so, rid = outputs
    for buf in (out, pp, so):
        if buf is not None:
            buf.zero_()
    rid.fill_(-1)[:, -1] = 0
    return outputs

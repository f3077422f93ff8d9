"""Triton code of the merge (``qmoe::unpermute``: ``unpermute_gather_kernel``; quantized
rows, ``qmoe::unpermute_fp8``: ``unpermute_fp8_kernel``) and of the weighted merge's
backward in one pass (``merge_backward_kernel``), with their launchers at the end.

Glossary: T tokens, H hidden, N permuted rows, S map slots a token, P weight columns
(E for a mask map, K for an index map), KB routes a step, BLOCK_H columns a tile,
BLOCK_P = next_pow2(P).

The merge ``out[t] = sum_k w[t, c_k] * x[row_k]`` has two gradients that read the same
rows: ``grad_x[row_k] = w[t, c_k] * g[t]`` and ``grad_w[t, c_k] = <g[t], x[row_k]>``. One
program per token computes both while it holds ``g[t]``'s tile: ``g`` is read once per KB
routes instead of once more by a separate scatter, and the weights' gradient row is written
whole (zeros off the routes, in the weights' dtype), so no zero fill and no cast launch.
"""

from __future__ import annotations

import functools
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from qmoe._intmath import cdiv, next_pow2
from qmoe._triton import launch
from qmoe.ops.kernels.permute import zero_unwritten_rows
from qmoe.ops.launch import assert_options, num_slots, unit_stride
from qmoe.ops.tuning import (
    MERGE_BACKWARD_FILL_BYTES,
    MergeBackwardTiling,
    fp8_merge_tile,
    merge_backward_tile,
    merge_tile,
)
from qmoe.tensors import layouts
from qmoe.tensors.kernels.quantize import fp8_bits_to_fp32
from qmoe.tensors.layouts import fp8_fields

#: no overrides: the defaults (frozen, so one instance serves every call)
_DEFAULTS = MergeBackwardTiling()

# The scale layouts (``LAYOUT``) the FP8 merge compares against, as compile-time constants.
FP8_PER_TENSOR = tl.constexpr(layouts.FP8_PER_TENSOR)
FP8_BLOCK_FP32 = tl.constexpr(layouts.FP8_BLOCK_FP32)


@triton.jit
def merge_backward_kernel(
    g_ptr,  # (T, H) gradient of the merged output, contiguous
    x_ptr,  # (N, H) the merge's forward input, contiguous
    map_ptr,  # (T, 2S+1) int32 row_id_map
    w_ptr,  # (T, P) float merging weights, row stride stride_w
    gx_ptr,  # (N, H) g's dtype out: w * g[t] at each of t's rows
    written_ptr,  # (N,) int8, zero-initialized: 1 for every row written (if HAS_FLAGS)
    gw_ptr,  # (T, P) weights' dtype out, contiguous: <g[t], x[row]> at each route's column
    N,
    H,
    S,
    P,
    stride_w,
    KB: tl.constexpr,  # routes a step (their row tiles in flight together)
    BLOCK_H: tl.constexpr,
    BLOCK_P: tl.constexpr,
    HAS_FLAGS: tl.constexpr,  # flag the rows written (else gx was zeroed before)
):
    """Grid ``(T,)``. Dot products in fp32, per route each lane adding its columns tile by
    tile, then one sum across the lanes (a fixed order: deterministic)."""
    t = tl.program_id(0).to(tl.int64)
    mrow = map_ptr + t * (2 * S + 1)
    n = tl.minimum(tl.load(mrow + 2 * S), S)  # a count past S never reads past the row
    pc = tl.arange(0, BLOCK_P)
    gw_row = tl.zeros((BLOCK_P,), dtype=tl.float32)
    for s0 in range(0, n, KB):
        sl = s0 + tl.arange(0, KB)
        d = tl.load(mrow + sl, mask=sl < n, other=-1).to(tl.int64)
        live = (sl < n) & (d >= 0) & (d < N)  # a row outside [0, N) is never touched
        c = tl.load(mrow + S + sl, mask=live, other=0)
        w = tl.load(w_ptr + t * stride_w + c, mask=live, other=0.0).to(tl.float32)
        acc = tl.zeros((KB, BLOCK_H), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            hmask = cols < H
            m = live[:, None] & hmask[None, :]
            g = tl.load(g_ptr + t * H + cols, mask=hmask, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + d[:, None] * H + cols[None, :], mask=m, other=0.0)
            acc += g[None, :] * x.to(tl.float32)
            tl.store(gx_ptr + d[:, None] * H + cols[None, :],
                     (g[None, :] * w[:, None]).to(gx_ptr.dtype.element_ty), mask=m)
        if HAS_FLAGS:
            tl.store(written_ptr + d, tl.full((KB,), 1, dtype=tl.int8), mask=live)
        dots = tl.sum(acc, axis=1)  # [KB]: each route's column gets its own dot
        hit = (pc[None, :] == c[:, None]) & live[:, None]
        gw_row += tl.sum(tl.where(hit, dots[:, None], 0.0), axis=0)
    tl.store(gw_ptr + t * P + pc, gw_row.to(gw_ptr.dtype.element_ty), mask=pc < P)


@triton.jit
def _route(mrow, S, s, n, w_row_ptr, P, HAS_W: tl.constexpr):
    """Route s of a token: ``(row, weight, bad weight column)``; weight 1.0 without HAS_W.
    ``s`` is clamped into ``[0, max(n, 1))``, so a load past the last route, or for a token
    with none, stays inside the map row (the launcher skips maps with S = 0). The bf16/fp16/
    fp32 merge loads route s + 1 this way while route s's row is in flight, so each route
    costs one memory round trip, not two (the map entry, then the row)."""
    sc = tl.maximum(tl.minimum(s, n - 1), 0)
    d = tl.load(mrow + sc).to(tl.int64)
    w, cbad = _route_weight(mrow, S, sc, w_row_ptr, P, HAS_W)
    return d, w, cbad


@triton.jit
def _route_weight(mrow, S, s, w_row_ptr, P, HAS_W: tl.constexpr):
    """Route s's weight ``w_row_ptr[map[S + s]]`` (fp32) and 1 if that column is outside
    ``[0, P)`` (then a column inside is read instead: the weights row holds at least one
    column even when P = 0); ``(1.0, 0)`` without HAS_W."""
    if HAS_W:
        c = tl.load(mrow + S + s)
        return (tl.load(w_row_ptr + tl.minimum(tl.maximum(c, 0), tl.maximum(P - 1, 0))).to(
                tl.float32),
                ((c < 0) | (c >= P)).to(tl.int32))
    else:
        return 1.0, 0


@triton.jit
def _checked_row(d, N_IN, hmask, bad, BLOCK_H: tl.constexpr):
    """A route's input row kept inside ``[0, N_IN)``: ``(row, load mask, bad)``. An
    out-of-range row becomes row 0 with an empty mask (it adds zero), and sets ``bad`` (the
    merge kernels' ``(1,)`` int32 problem flag)."""
    inr = (d >= 0) & (d < N_IN)
    dv = tl.zeros((BLOCK_H,), dtype=tl.int64) + d
    lmask = hmask & (dv >= 0) & (dv < N_IN)
    return tl.where(inr, d, 0), lmask, bad | (~inr).to(tl.int32)


@triton.jit
def _merge_add(acc, x, w, cbad, bad, HAS_W: tl.constexpr):
    """``acc + x * w`` (``acc + x`` without HAS_W); a NaN weight or a weight column outside
    the probs (``cbad``) sets ``bad``."""
    if HAS_W:
        return acc + x * w, bad | (w != w).to(tl.int32) | cbad
    else:
        return acc + x, bad


@triton.jit
def check_routes(bad):
    """The merge kernels' input check: a device-side assert that ``bad`` ((1,) int32, set
    by ``_checked_row`` / ``_merge_add``) is 0. Compiled in only when the kernel is launched
    with ``debug=True`` (the launchers pass ``launch.assert_options()``); it fails as
    ``torch._assert_async`` does, surfacing at the next synchronization."""
    tl.device_assert(bad == 0, "qmoe merge: row_id_map points past the rows of inp, or "
                     "merging_probs holds NaN or fewer columns than the map's slots; pass "
                     "the permute's output with the row_id_map built for it, and finite "
                     "probs of the routing's shape")


@triton.jit
def unpermute_gather_kernel(
    inp_ptr,  # (N, H) any float dtype, contiguous
    out_ptr,  # (T, H) output dtype, contiguous
    map_ptr,  # (T, 2S+1) int32
    w_ptr,  # (T, P) merging weights, row stride stride_w (read only if HAS_W)
    H,
    S,
    N_IN,
    stride_w,
    P,  # columns of the weights (a route's column >= P is an error; w_ptr holds >= 1),
    # or with HAS_GP (and no weights) the columns of gp
    gpp_ptr,  # (N_IN,) float: gradient of the permuted probs (read only if HAS_GP)
    gp_ptr,  # (T, P) float out, contiguous: gpp at each kept route's column, else 0 (HAS_GP)
    HAS_W: tl.constexpr,
    HAS_GP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_P: tl.constexpr,  # next_pow2(P) with HAS_GP
    EVICT: tl.constexpr,  # cache hint of the row loads and the store ("" or "evict_first")
    PAIRS: tl.constexpr,  # two routes a step (else one)
):
    """out[t] = sum over t's rows of inp[row] (* weight), accumulated in fp32 in row order.
    A row outside ``[0, N_IN)`` is never read (it adds zero and fails ``check_routes``), nor
    a weight column outside ``[0, P)``. With PAIRS two routes' rows are in flight a step (loaded
    together, then added in order) and the next two routes' map entries load meanwhile;
    without, one route a step with the next one's map entry loading meanwhile."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = cols < H
    mrow = map_ptr + t * (2 * S + 1)
    n = tl.minimum(tl.load(mrow + 2 * S), S)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    bad = tl.zeros((1,), dtype=tl.int32) + (n < 0).to(tl.int32)  # (1,): any problem seen
    wrow = w_ptr + t * stride_w
    if PAIRS:
        acc, bad = _merge_pairs(inp_ptr, mrow, wrow, n, S, P, H, N_IN, cols, hmask, acc, bad,
                                HAS_W, BLOCK_H, EVICT)
    else:
        d_next, w_next, c_next = _route(mrow, S, 0, n, wrow, P, HAS_W)
        for s in range(0, n):
            d, w, cbad = d_next, w_next, c_next
            d_next, w_next, c_next = _route(mrow, S, s + 1, n, wrow, P, HAS_W)
            d, lmask, bad = _checked_row(d, N_IN, hmask, bad, BLOCK_H)
            x = tl.load(inp_ptr + d * H + cols, mask=lmask, other=0.0,
                        eviction_policy=EVICT).to(tl.float32)
            acc, bad = _merge_add(acc, x, w, cbad, bad, HAS_W)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=hmask,
             eviction_policy=EVICT)
    # a permute's backward: the probs' gradient row, by the first column tile (nested: a
    # compile-time flag and a program id do not combine with `and` in Triton)
    if HAS_GP:  # noqa: SIM102
        if tl.program_id(1) == 0:
            _probs_grad_row(mrow, S, n, N_IN, gpp_ptr, gp_ptr + t * P, P, BLOCK_P)
    check_routes(bad)


@triton.jit
def _probs_grad_row(mrow, S, n, N_IN, gpp_ptr, gp_row_ptr, P, BLOCK_P: tl.constexpr):
    """One token's row of a permute's probs gradient: ``gpp[row]`` at the column of each of
    its n kept routes (a row outside ``[0, N_IN)`` gives 0; the merge's check reports it),
    zeros at the other columns, stored whole in gp's dtype."""
    pc = tl.arange(0, BLOCK_P)
    row = tl.zeros((BLOCK_P,), dtype=tl.float32)
    for s in range(0, n):
        d = tl.zeros((BLOCK_P,), dtype=tl.int64) + tl.load(mrow + s)  # (a vector: the
        c = tl.load(mrow + S + s)  # interpreter takes vector masks only)
        hit = (pc == c) & (d >= 0) & (d < N_IN)
        v = tl.load(gpp_ptr + tl.where(hit, d, 0), mask=hit, other=0.0).to(tl.float32)
        row = tl.where(pc == c, v, row)
    tl.store(gp_row_ptr + pc, row.to(gp_row_ptr.dtype.element_ty), mask=pc < P)


@triton.jit
def _merge_pairs(inp_ptr, mrow, wrow, n, S, P, H, N_IN, cols, hmask, acc, bad,
                 HAS_W: tl.constexpr, BLOCK_H: tl.constexpr, EVICT: tl.constexpr):
    """``(acc, bad)`` after adding a token's n routes two a step (``unpermute_gather_kernel``'s
    PAIRS loop; arguments as there, ``mrow`` / ``wrow`` its map and weights rows)."""
    da, wa, ca = _route(mrow, S, 0, n, wrow, P, HAS_W)
    db, wb, cb = _route(mrow, S, 1, n, wrow, P, HAS_W)
    for s in range(0, n, 2):
        d0, w0, c0 = da, wa, ca
        d1, w1, c1 = db, wb, cb
        da, wa, ca = _route(mrow, S, s + 2, n, wrow, P, HAS_W)
        db, wb, cb = _route(mrow, S, s + 3, n, wrow, P, HAS_W)
        d0, m0, bad = _checked_row(d0, N_IN, hmask, bad, BLOCK_H)
        d1, m1, bad = _checked_row(d1, N_IN, hmask, bad, BLOCK_H)
        # (BLOCK_H,): route s + 1 exists (a vector: the interpreter takes vector masks only;
        # past the last route, _route repeats route n - 1, which is never added twice)
        two = (cols * 0 + s + 1) < n
        x0 = tl.load(inp_ptr + d0 * H + cols, mask=m0, other=0.0,
                     eviction_policy=EVICT).to(tl.float32)
        x1 = tl.load(inp_ptr + d1 * H + cols, mask=m1 & two, other=0.0,
                     eviction_policy=EVICT).to(tl.float32)
        acc, bad = _merge_add(acc, x0, w0, c0, bad, HAS_W)
        acc1, bad = _merge_add(acc, x1, w1, c1, bad, HAS_W)
        acc = tl.where(two, acc1, acc)
    return acc, bad


@triton.jit
def unpermute_fp8_kernel(
    q_ptr,  # (N, H) uint8: fp8 bits of the permuted rows, contiguous
    s_ptr,  # LAYOUT 0: () fp32; 1: (N, NB) fp32 block scales; 2: (N, NB) uint8 e8m0 bits
    out_ptr,  # (T, H) output dtype, contiguous
    map_ptr,  # (T, 2S+1) int32
    w_ptr,  # (T, P) merging weights, row stride stride_w (read only if HAS_W)
    H,
    S,
    N_IN,
    NB,
    stride_w,
    P,  # columns of the weights (a route's column >= P is an error; w_ptr holds >= 1)
    LAYOUT: tl.constexpr,
    BS: tl.constexpr,  # scale block along H (LAYOUT 1 and 2)
    MB: tl.constexpr,
    BIAS: tl.constexpr,
    HW_CAST: tl.constexpr,
    HAS_W: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EVICT: tl.constexpr,  # cache hint of the fp8 row loads and the store ("" or "evict_first")
):
    """The merge of quantized rows: each row is dequantized in registers (fp8 value times
    its block's scale, fp32) and summed in fp32 in row order, as ``unpermute_gather_kernel``."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = cols < H
    mrow = map_ptr + t * (2 * S + 1)
    n = tl.minimum(tl.load(mrow + 2 * S), S)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    bad = tl.zeros((1,), dtype=tl.int32) + (n < 0).to(tl.int32)  # (1,): any problem seen
    if LAYOUT == FP8_PER_TENSOR:
        st = tl.load(s_ptr)
    wrow = w_ptr + t * stride_w
    # No load-ahead of the next route here: on the H200 it makes this kernel slower (MXFP8
    # merge at qwen3: 78% of copy without, 60% with), while the bf16 merge gains from it
    # (docs/benchmarks.md, "FP8 merge (`fp8_merge_tile`; no load-ahead)").
    for s in range(0, n):
        d, lmask, bad = _checked_row(tl.load(mrow + s).to(tl.int64), N_IN, hmask, bad, BLOCK_H)
        b = tl.load(q_ptr + d * H + cols, mask=lmask, other=0, eviction_policy=EVICT)
        v = fp8_bits_to_fp32(b, MB, BIAS, HW_CAST)
        if LAYOUT == FP8_PER_TENSOR:
            x = v * st
        else:
            # Unmasked, with the block index clamped into the row (d is a row of inp, or 0,
            # and the launcher guarantees a row 0): a thread's columns then share one load;
            # masked by column, the sm_90 build issued one load per column for fp32 scales.
            sidx = d * NB + tl.minimum(cols // BS, NB - 1)
            if LAYOUT == FP8_BLOCK_FP32:
                sc = tl.load(s_ptr + sidx)
            else:
                sb = tl.load(s_ptr + sidx).to(tl.int32)
                sc = (sb << 23).to(tl.float32, bitcast=True)
                sc = tl.where(sb == 0, 5.877471754111438e-39, sc)  # 2**-127
                nan = tl.full(sc.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
                sc = tl.where(sb == 255, nan, sc)
            x = v * sc
        w, cbad = _route_weight(mrow, S, s, wrow, P, HAS_W)
        acc, bad = _merge_add(acc, x, w, cbad, bad, HAS_W)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=hmask,
             eviction_policy=EVICT)
    check_routes(bad)


# ------------------------------------------------------------------------- launchers


def _weights_arg(weights: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(w, P)`` for the merge kernels: the weights and their columns. Without weights,
    ``like`` (2D) stands in and is never read; weights of zero columns get a one-column
    stand-in with P = 0, so any route fails the kernel's check and the clamped read stays in
    bounds."""
    if weights is None:
        return like, 1
    if weights.shape[1] == 0:
        return weights.new_zeros((max(weights.shape[0], 1), 1)), 0
    return unit_stride(weights), weights.shape[1]


def unpermute_rows_triton(
    x: torch.Tensor,
    rid: torch.Tensor,
    weights: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out [T, H]``: the sum of each token's rows of ``x [N, H]`` (times ``weights[t,
    col]``, ``weights [T, P]``), accumulated in fp32 in row order, in ``out_dtype`` (default
    x's). A row outside ``x`` or a NaN weight fails a device assert. ``out`` (tests:
    poisoned) receives the sums. No host sync."""
    t, h = rid.shape[0], x.shape[1]
    if out is None:
        out = torch.empty(t, h, dtype=out_dtype or x.dtype, device=x.device)
    if t == 0 or h == 0:
        return out
    _merge(x, rid, weights, out)
    return out


def permute_backward_triton(
    grad_out: torch.Tensor,
    rid: torch.Tensor,
    grad_probs: torch.Tensor,
    num_cols: int,
    probs_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A permute's backward in one launch: ``(grad_inp [T, H] in grad_out's dtype, the sum
    of each token's rows of grad_out [N, H] in fp32; grad_probs_in [T, num_cols] in
    probs_dtype, grad_probs [N] at each kept route's column, zeros elsewhere)``. No host
    sync."""
    t, h = rid.shape[0], grad_out.shape[1]
    gi = torch.empty(t, h, dtype=grad_out.dtype, device=grad_out.device)
    gp = torch.empty(t, num_cols, dtype=probs_dtype, device=grad_out.device)
    if t == 0:
        return gi, gp
    _merge(grad_out, rid, None, gi, (grad_probs, gp))
    return gi, gp


def _merge(x, rid, weights, out, probs_grad=None) -> None:
    """Launch ``unpermute_gather_kernel`` for ``out [T, H]`` (T > 0), and with
    ``probs_grad = (grad_probs [N], gp [T, P])`` the permute backward's probs gradient."""
    t, h = out.shape
    x, rid = x.contiguous(), rid.contiguous()
    if num_slots(rid) == 0:  # no routes: nothing to read
        out.zero_()
        if probs_grad is not None:
            probs_grad[1].zero_()
        return
    w, p = _weights_arg(weights, x)
    gpp = gp = None
    if probs_grad is not None:
        gpp, gp = probs_grad
        gpp, p = gpp.contiguous(), gp.shape[1]
    bh, options = _merge_plan(h, weights is not None, p if gp is not None else None)
    launch(unpermute_gather_kernel, (t, max(cdiv(h, bh), 1)),
        x, out, rid, w, h, num_slots(rid), x.shape[0], w.stride(0), p, gpp, gp, **options)


@functools.lru_cache(maxsize=256)
def _merge_plan(h: int, has_w: bool, gp_cols: int | None):
    """``(BLOCK_H, launch options)`` of ``unpermute_gather_kernel`` for rows of ``h``, with
    weights or not, and with a probs gradient of ``gp_cols`` columns (None: none): pure in
    its arguments, so kept per process (no data; the options read-only)."""
    bh, nw, evict, pairs = merge_tile(h, has_w)
    return bh, MappingProxyType(dict(
        HAS_W=has_w, HAS_GP=gp_cols is not None, BLOCK_H=bh,
        BLOCK_P=next_pow2(max(gp_cols, 1)) if gp_cols is not None else 1, EVICT=evict,
        PAIRS=pairs, num_warps=nw, **assert_options(),  # check_routes
    ))


def unpermute_fp8_triton(
    qbits: torch.Tensor,
    scale: torch.Tensor,
    layout: int,
    block_size: int,
    fp8_dtype: torch.dtype,
    rid: torch.Tensor,
    weights: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Merge of quantized rows ``qbits [N, H]`` (uint8 fp8 bits) with their scales
    (``layout``: a ``qmoe.tensors.layouts`` FP8 scale layout): each row dequantized in the
    kernel and summed in fp32; ``[T, H]`` in ``out_dtype``. No host sync."""
    t, h = rid.shape[0], qbits.shape[1]
    out = torch.empty(t, h, dtype=out_dtype, device=qbits.device)
    if t == 0 or h == 0:
        return out
    bh, nw, evict = fp8_merge_tile(h)
    mb, bias = fp8_fields(fp8_dtype)
    if num_slots(rid) == 0:
        return out.zero_()  # no routes: nothing to read
    w, p = _weights_arg(weights, qbits)
    scale, rid = scale.contiguous(), rid.contiguous()
    # the kernel reads scale row 0 of a bad route
    if layout != layouts.FP8_PER_TENSOR and qbits.shape[0] == 0:
        scale = scale.new_zeros((1, scale.shape[-1]))
    launch(unpermute_fp8_kernel, (t, cdiv(h, bh)),
        qbits.contiguous(), scale, out, rid, w, h, num_slots(rid),
        qbits.shape[0], scale.shape[-1] if scale.dim() else 1, w.stride(0), p,
        LAYOUT=layout, BS=max(block_size, 1), MB=mb, BIAS=bias,
        HW_CAST=qbits.is_cuda, HAS_W=weights is not None, BLOCK_H=bh, EVICT=evict,
        num_warps=nw, **assert_options(),  # check_routes
    )
    return out


def merge_backward_triton(
    grad_out: torch.Tensor,
    fwd_inp: torch.Tensor,
    row_id_map: torch.Tensor,
    merging_probs: torch.Tensor,
    tiling: MergeBackwardTiling | None = None,
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both gradients of the weighted merge in one pass: ``(grad_inp [N, H] in grad_out's
    dtype, grad_merging_probs [T, P] in merging_probs' dtype)`` for ``grad_out [T, H]``, the
    merge's input ``fwd_inp [N, H]`` and ``merging_probs [T, P]``. Rows no token reads are
    zero: up to ``MERGE_BACKWARD_FILL_BYTES`` grad_inp is zeroed first (two launches),
    above it the rows written are flagged and the others zeroed by a last launch (three).
    ``tiling`` overrides ``merge_backward_tile`` (benchmarks); ``out`` (tests: poisoned)
    receives ``grad_inp``. No host sync."""
    t, h = grad_out.shape
    n, p = fwd_inp.shape[0], merging_probs.shape[1]
    dev = grad_out.device
    gi = torch.empty((n, h), dtype=grad_out.dtype, device=dev) if out is None else out
    gw = torch.empty((t, p), dtype=merging_probs.dtype, device=dev)
    if t == 0:
        return gi.zero_(), gw
    merging_probs, row_id_map = unit_stride(merging_probs), row_id_map.contiguous()
    o = tiling or _DEFAULTS
    kb, bh, nw = merge_backward_tile(h, p)
    flags = gi.numel() * gi.element_size() > MERGE_BACKWARD_FILL_BYTES
    written = torch.zeros(n, dtype=torch.int8, device=grad_out.device) if flags else None
    if not flags:
        gi.zero_()
    launch(merge_backward_kernel, (t,),
        grad_out.contiguous(), fwd_inp.contiguous(), row_id_map, merging_probs, gi, written,
        gw, n, h, num_slots(row_id_map), p, merging_probs.stride(0), KB=o.kb or kb,
        BLOCK_H=o.block_h or bh, BLOCK_P=next_pow2(p), HAS_FLAGS=flags,
        num_warps=o.num_warps or nw,
    )
    if flags and n:
        zero_unwritten_rows(gi, written)
    return gi, gw

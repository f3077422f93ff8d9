"""Triton code of the scatter that moves token rows to their permuted rows, and its
launcher ``permute_rows_triton`` (the CUDA kernel of ``qmoe::permute``; the fused permutes
share its device functions).

Glossary: T tokens, H hidden, S slots per token in the row_id_map, N output rows,
P columns of the probs tensor (E for a mask map, K for an index map), R row ranges in
``fill`` (the rows no route writes), Z programs sharing the last of them.

row_id_map layout (``qmoe/ops/row_id_map.py``): ``int32 [T, 2*S + 1]``; for token t the
first ``n = map[t, 2S]`` entries are its output rows and ``map[t, S:S+n]`` the probs
columns that weight them. Programs cover one token (or one block of rows) and one
``BLOCK_H`` chunk of the hidden dim; row offsets are int64, so N*H may pass 2**31.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qmoe._intmath import cdiv, next_pow2
from qmoe._triton import launch
from qmoe.ops.launch import assert_options, num_slots, unit_stride
from qmoe.ops.tuning import scatter_tile, tail_programs, zero_rows_tile


@triton.jit
def zero_fill_rows(
    g,  # index of this program among the launch's fill programs, [0, R - 1 + Z)
    fill_ptr,  # (R, 2) int32: row ranges [lo, hi) no route writes (row_id_map.py)
    R,
    Z,  # programs sharing the last range (the tail, which may be long)
    N,
    out_ptr,  # (N, H) rows to zero (any dtype), contiguous
    H,
    cols,  # this program's columns of a row (any shape), and their mask
    cmask,
    side_ptr,  # (N, NS) side rows to zero alike (if HAS_SIDE), contiguous
    NS,
    scols,  # side columns this program zeroes (any shape), and their mask
    smask,
    pp_ptr,  # (N,) permuted probs to zero (if HAS_P and first)
    first,  # this program owns the row's probs
    HAS_SIDE: tl.constexpr,
    HAS_P: tl.constexpr,
):
    """Zero the output rows no route writes, inside the scatter launch: ranges 0..R-2 (a
    padded map's padding, shorter than the alignment) take one program each, the last
    range is split over Z programs. Rows are kept inside [0, N) whatever ``fill`` says."""
    if g < R - 1:
        lo = tl.load(fill_ptr + 2 * g).to(tl.int32)
        hi = tl.load(fill_ptr + 2 * g + 1).to(tl.int32)
    else:
        lo, hi = _tail_share(tl.load(fill_ptr + 2 * (R - 1)).to(tl.int32),
                             tl.load(fill_ptr + 2 * (R - 1) + 1).to(tl.int32), g - (R - 1), Z)
    zero_rows(lo, hi, N, out_ptr, H, cols, cmask, side_ptr, NS, scols, smask, pp_ptr, first,
              HAS_SIDE, HAS_P)


@triton.jit
def _tail_share(t_lo, t_hi, j, Z):
    """Rows ``[lo, hi)`` of the tail range ``[t_lo, t_hi)`` that share ``j`` of ``Z`` zeroes."""
    t_lo = tl.maximum(t_lo, 0)
    per = (t_hi - t_lo + Z - 1) // Z
    lo = t_lo + j * per
    return lo, tl.minimum(t_hi, lo + per)


@triton.jit
def zero_rows(lo, hi, N, out_ptr, H, cols, cmask, side_ptr, NS, scols, smask, pp_ptr, first,
              HAS_SIDE: tl.constexpr, HAS_P: tl.constexpr):
    """Zero rows ``[lo, hi)`` (kept inside ``[0, N)``) of ``out`` over ``cols``, and
    alike of ``side`` and ``pp`` (arguments as in ``zero_fill_rows``)."""
    lo = tl.maximum(lo, 0)
    hi = tl.minimum(hi, N)
    zero = tl.zeros(cols.shape, dtype=out_ptr.dtype.element_ty)
    lo64 = lo.to(tl.int64)
    for i in range(0, hi - lo):
        r64 = lo64 + i
        tl.store(out_ptr + r64 * H + cols, zero, mask=cmask)
        if HAS_SIDE:
            tl.store(side_ptr + r64 * NS + scols,
                     tl.zeros(scols.shape, dtype=side_ptr.dtype.element_ty), mask=smask)
        if HAS_P:
            tl.store(pp_ptr + r64, tl.zeros((), dtype=pp_ptr.dtype.element_ty), mask=first)


@triton.jit
def permute_scatter_kernel(
    inp_ptr,  # (T, H) any dtype, row stride stride_in
    out_ptr,  # (N, H) same dtype, contiguous
    map_ptr,  # (T, 2S+1) int32
    w_ptr,  # (T, P) float weights, row stride stride_w (read only if HAS_W)
    written_ptr,  # (N,) int8, zero-initialized: 1 for every row written (if not HAS_FILL)
    fill_ptr,  # (R, 2) int32 row ranges no route writes (if HAS_FILL)
    p_ptr,  # (T, P) float probs, row stride stride_p (read only if HAS_P)
    pp_ptr,  # (N,) probs dtype out: the permuted probs (written only if HAS_P)
    side_ptr,  # (T, NS) side rows moved with the data, e.g. block scales (if HAS_SIDE)
    side_out_ptr,  # (N, NS) side rows out, contiguous (written only if HAS_SIDE)
    T,
    N,
    H,
    S,
    NS,
    R,
    Z,
    stride_in,
    stride_w,
    stride_p,
    stride_side,
    HAS_W: tl.constexpr,
    HAS_P: tl.constexpr,
    HAS_SIDE: tl.constexpr,
    HAS_FILL: tl.constexpr,
    KB: tl.constexpr,  # routes written per step (their rows are loaded together)
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= NS when HAS_SIDE
):
    """Programs ``t < T``: read token t's row once; write it (times its weight, if HAS_W)
    to each of its rows, and (if HAS_P) its probs, (if HAS_SIDE) its side row, to the same
    rows of ``pp`` and ``side_out``. With HAS_FILL, programs ``t >= T`` zero the rows no
    route writes (``zero_fill_rows``); without it, rows written are flagged in ``written``
    for ``zero_rows_kernel``."""
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = cols < H
    if pid >= T:  # fill programs (the grid holds only the T token programs without fill)
        if HAS_FILL:
            sc = tl.arange(0, BLOCK_S)
            first = tl.program_id(1) == 0
            ns_here = tl.where(first, NS, 0)  # side rows: the first column block's job
            zero_fill_rows(pid - T, fill_ptr, R, Z, N, out_ptr, H, cols, hmask, side_out_ptr,
                           NS, sc, sc < ns_here, pp_ptr, first, HAS_SIDE, HAS_P)
    else:
        t = pid.to(tl.int64)
        x = tl.load(inp_ptr + t * stride_in + cols, mask=hmask)
        _scatter_token(t, x, out_ptr, map_ptr, w_ptr, written_ptr, p_ptr, pp_ptr, side_ptr,
                       side_out_ptr, N, S, NS, H, cols, hmask, stride_w, stride_p,
                       stride_side, HAS_W, HAS_P, HAS_SIDE, not HAS_FILL, KB, BLOCK_H, BLOCK_S)


@triton.jit
def _scatter_token(t, x, out_ptr, map_ptr, w_ptr, written_ptr, p_ptr, pp_ptr, side_ptr,
                   side_out_ptr, N, S, NS, H, cols, hmask, stride_w, stride_p, stride_side,
                   HAS_W: tl.constexpr, HAS_P: tl.constexpr, HAS_SIDE: tl.constexpr,
                   FLAGS: tl.constexpr, KB: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_S: tl.constexpr):
    """Token t's share of ``permute_scatter_kernel``: ``x`` is its row over ``cols``
    (loaded by the caller; other arguments as there; FLAGS: mark the rows written in
    ``written``)."""
    mrow = map_ptr + t * (2 * S + 1)
    # The row (loaded by the caller), the count and the first KB slots load together: the
    # first stores wait for one memory round trip, not two (most tokens have <= KB routes).
    n = tl.minimum(tl.load(mrow + 2 * S), S)  # a count past S never reads past the row
    d0 = tl.load(mrow + tl.arange(0, KB), mask=tl.arange(0, KB) < S, other=-1)
    for s0 in range(0, n, KB):
        sl = s0 + tl.arange(0, KB)
        if s0 == 0:
            d = d0.to(tl.int64)
        else:
            d = tl.load(mrow + sl, mask=sl < n, other=-1).to(tl.int64)
        smask = (sl < n) & (d >= 0) & (d < N)  # a row outside [0, N) is never written
        if HAS_W or HAS_P:
            c = tl.load(mrow + S + sl, mask=smask, other=0)
        else:
            c = tl.zeros((KB,), dtype=tl.int32)
        store_routes(t, x, d, c, smask, out_ptr, w_ptr, written_ptr, p_ptr, pp_ptr, side_ptr,
                     side_out_ptr, NS, H, cols, hmask, stride_w, stride_p, stride_side, HAS_W,
                     HAS_P, HAS_SIDE, FLAGS, KB, BLOCK_H, BLOCK_S)


@triton.jit
def assert_probs_not_nan(pv):
    """The permute kernels' probs check: a device-side assert that the probs of the routes
    they move hold no NaN (compiled in only when launched with ``debug=True``, as
    ``check_routes``); it replaces a pass over all of ``probs`` and its assert launch."""
    tl.device_assert(pv == pv, "qmoe permute: probs holds NaN (a routed entry); fix the "
                     "router upstream")


@triton.jit
def store_routes(t, x, d, c, smask, out_ptr, w_ptr, written_ptr, p_ptr, pp_ptr, side_ptr,
                 side_out_ptr, NS, H, cols, hmask, stride_w, stride_p, stride_side,
                 HAS_W: tl.constexpr, HAS_P: tl.constexpr, HAS_SIDE: tl.constexpr,
                 FLAGS: tl.constexpr, KB: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_S: tl.constexpr):
    """Write token t's row ``x`` (over ``cols``) to the KB output rows ``d`` (int64) where
    ``smask``, with its weight / probs from column ``c`` of its weights / probs row, its
    side row, and (FLAGS) the rows' ``written`` flags (arguments as in
    ``permute_scatter_kernel``)."""
    if HAS_W:
        w = tl.load(w_ptr + t * stride_w + c, mask=smask, other=0.0).to(tl.float32)
        y = (x.to(tl.float32)[None, :] * w[:, None]).to(out_ptr.dtype.element_ty)
    else:
        y = tl.broadcast_to(x[None, :], (KB, BLOCK_H))
    tl.store(out_ptr + d[:, None] * H + cols[None, :], y, mask=smask[:, None] & hmask[None, :])
    if tl.program_id(1) == 0:
        if FLAGS:
            tl.store(written_ptr + d, tl.full((KB,), 1, dtype=tl.int8), mask=smask)
        if HAS_P:
            pv = tl.load(p_ptr + t * stride_p + c, mask=smask, other=0.0)
            assert_probs_not_nan(pv)
            tl.store(pp_ptr + d, pv, mask=smask)
        if HAS_SIDE:
            sc = tl.arange(0, BLOCK_S)
            scm = sc < NS
            sv = tl.load(side_ptr + t * stride_side + sc, mask=scm)
            tl.store(side_out_ptr + d[:, None] * NS + sc[None, :],
                     tl.broadcast_to(sv[None, :], (KB, BLOCK_S)),
                     mask=smask[:, None] & scm[None, :])


@triton.jit
def zero_rows_kernel(
    out_ptr,  # (N, H), contiguous
    written_ptr,  # (N,) int8: 1 where some token wrote the row
    pp_ptr,  # (N,) permuted probs (zeroed alike only if HAS_P)
    side_ptr,  # (N, NS) side rows (zeroed alike only if HAS_SIDE)
    N,
    H,
    NS,
    HAS_P: tl.constexpr,
    HAS_SIDE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Zero the rows nothing was written to (padding, and rows past the routed count).
    A block of rows that are all written costs one small load."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < N
    w = tl.load(written_ptr + rows, mask=rmask, other=1)
    todo = rmask & (w == 0)
    if tl.max(todo.to(tl.int32), axis=0) > 0:
        if HAS_P:
            tl.store(pp_ptr + rows, tl.zeros((BLOCK_R,), dtype=pp_ptr.dtype.element_ty), mask=todo)
        if HAS_SIDE:
            sc = tl.arange(0, BLOCK_S)
            tl.store(side_ptr + rows.to(tl.int64)[:, None] * NS + sc[None, :],
                     tl.zeros((BLOCK_R, BLOCK_S), dtype=side_ptr.dtype.element_ty),
                     mask=todo[:, None] & (sc < NS)[None, :])
        zero = tl.zeros((BLOCK_R, BLOCK_H), dtype=out_ptr.dtype.element_ty)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            offs = rows.to(tl.int64)[:, None] * H + cols[None, :]
            tl.store(out_ptr + offs, zero, mask=todo[:, None] & (cols < H)[None, :])


# ------------------------------------------------------------------------- launchers


def permute_rows_triton(
    x: torch.Tensor,
    rid: torch.Tensor,
    n: int,
    weights: torch.Tensor | None = None,
    *,
    probs: torch.Tensor | None = None,
    probs_out: torch.Tensor | None = None,
    side: torch.Tensor | None = None,
    side_out: torch.Tensor | None = None,
    fill: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out [N, H]``: each token's row of ``x [T, H]`` (times ``weights[t, col]``,
    ``weights [T, P]`` float, if given) at its rows of ``rid`` (row_id_map); rows no route
    writes are zero. With ``probs [T, P]``, also fills ``probs_out [N]`` (probs' dtype) with
    each route's ``probs[t, col]`` at its row, zero elsewhere, in the same pass; with
    ``side [T, NS]`` (block scales of quantized rows), fills ``side_out [N, NS]`` alike.
    ``fill`` (``[R, 2]`` int32 from ``make_row_id_map``: the rows no route writes) lets
    the kernel zero those rows in the same launch; without it the rows written are
    flagged and a second launch zeroes the rest. ``out`` (tests: poisoned) receives the
    rows. No host sync."""
    t, h = x.shape
    if out is None:
        out = torch.empty(n, h, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    x, weights, probs = unit_stride(x), unit_stride(weights), unit_stride(probs)
    rid = rid.contiguous()  # rows of 2S+1 entries
    fill = fill.contiguous() if fill is not None else None
    bh, nw, kb = scatter_tile(h, x.element_size(), weights is not None)
    has_f = fill is not None
    # Arguments a launch does not use go in as None (Triton makes them compile-time
    # constants): each tensor argument costs about 2 us of host time per launch in Triton's
    # binding, which is most of a small eager call (``python -m benchmarks profile small``).
    written = None if has_f else torch.zeros(n, dtype=torch.int8, device=x.device)
    has_p = probs is not None
    has_s = side is not None
    side = unit_stride(side)
    ns = side.shape[1] if has_s else 0
    progs, r, z = scatter_programs(t, n, fill)
    if progs:
        has_w = weights is not None
        launch(permute_scatter_kernel, (progs, cdiv(max(h, 1), bh)),
            x, out, rid, weights, written, fill, probs, probs_out if has_p else None, side,
            side_out if has_s else None, t, n, h,
            num_slots(rid), ns, r, z, x.stride(0), weights.stride(0) if has_w else None,
            probs.stride(0) if has_p else None, side.stride(0) if has_s else None,
            HAS_W=has_w, HAS_P=has_p, HAS_SIDE=has_s, HAS_FILL=has_f, KB=kb, BLOCK_H=bh,
            BLOCK_S=next_pow2(max(ns, 1)), num_warps=nw,
            **assert_options(),  # assert_probs_not_nan
        )
    if not has_f:
        zero_unwritten_rows(out, written, probs_out if has_p else None,
                            side_out if has_s else None)
    return out


def zero_unwritten_rows(
    out: torch.Tensor,
    written: torch.Tensor,
    probs_out: torch.Tensor | None = None,
    side_out: torch.Tensor | None = None,
) -> None:
    """Zero the rows of ``out`` ``[N, H]`` (and of ``probs_out`` ``[N]``, ``side_out``
    ``[N, NS]``) whose ``written`` flag (``[N]`` int8) a scatter left 0."""
    n, h = out.shape
    ns = side_out.shape[1] if side_out is not None else 0
    br, bh, nw = zero_rows_tile(h)
    launch(zero_rows_kernel, (cdiv(n, br),),
        out, written, probs_out, side_out, n, h, ns, HAS_P=probs_out is not None,
        HAS_SIDE=side_out is not None, BLOCK_R=br, BLOCK_H=bh,
        BLOCK_S=next_pow2(max(ns, 1)), num_warps=nw,
    )


def scatter_programs(t: int, n: int, fill: torch.Tensor | None) -> tuple[int, int, int]:
    """``(programs along axis 0, R, Z)`` of a scatter launch: T token programs, then, with
    ``fill`` (``[R, 2]``), one program per padding range and Z sharing the last range (the
    tail of up to N rows; empty ones cost a load and exit)."""
    if fill is None:
        return t, 0, 0
    r, z = fill.shape[0], tail_programs(n)
    return t + r - 1 + z, r, z

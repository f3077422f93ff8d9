"""Triton code of the chunk sort in one launch (``sort_chunks_kernel``, launcher
``sort_chunks_triton``) and the row gather behind sorts of more chunks
(``gather_rows_kernel``, ``gather_rows_triton``).

Glossary: T rows, H hidden, C chunks, BLOCK_C = next_pow2(C), BLOCK_R rows a tile, STEPS
tiles a program.

Every program works out its rows' sources from the C split sizes and the chunk order
itself (one scan over BLOCK_C a program; a few masked sums over BLOCK_C a row only where
the program's rows span two chunks or more, else one offset for all), so the sort needs no
source-row array and no launches of its own for it; program 0 also checks the sizes and
the order with device asserts (launched with ``debug=True``), in place of the op's checks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qmoe._intmath import cdiv, next_pow2
from qmoe._triton import launch
from qmoe.ops.kernels.permute import assert_probs_not_nan
from qmoe.ops.launch import assert_options, unit_stride
from qmoe.ops.tuning import (
    SIDE_WIDE_MAX_COLS,
    SORT_CHUNKS_WARPS,
    SortChunksTiling,
    gather_tile,
    sort_chunks_tile,
)

#: no overrides: the defaults (frozen, so one instance serves every call)
_DEFAULTS = SortChunksTiling()


@triton.jit
def chunk_table(sizes_ptr, index_ptr, C, INVERSE: tl.constexpr, BLOCK_C: tl.constexpr):
    """``(idx, idx_in, sz, szs, end)``, ``[BLOCK_C]`` each: the order (as given, and
    clamped into [0, C)), the sizes in input order and in emitted order, and the
    inclusive prefix of the sizes in input order (INVERSE) or in emitted order. Entries
    past C are sizes 0 (their ends equal the total)."""
    cj = tl.arange(0, BLOCK_C)
    cm = cj < C
    idx = tl.load(index_ptr + cj, mask=cm, other=-1).to(tl.int32)  # padding matches no chunk
    idx_in = tl.minimum(tl.maximum(idx, 0), C - 1)
    sz = tl.load(sizes_ptr + cj, mask=cm, other=0).to(tl.int64)
    szs = tl.load(sizes_ptr + idx_in, mask=cm, other=0).to(tl.int64)
    end = tl.cumsum(sz, axis=0) if INVERSE else tl.cumsum(szs, axis=0)
    return idx, idx_in, sz, szs, end


@triton.jit
def chunk_sources(rows, idx, idx_in, sz, szs, end, T, C, INVERSE: tl.constexpr,
                  BLOCK_C: tl.constexpr):
    """``[BLOCK_R]`` int64: the row each of ``rows`` reads (``chunk_table``'s vectors).
    Forward: output row r lies in the j-th emitted chunk c = index[j] and reads input row
    ``in_start[c] + r - out_start[j]``. INVERSE (the backward): input row i of chunk c
    takes output row ``out_start[j] + i - in_start[c]`` where index[j] = c. Rows past the
    chunks read themselves; any result is clamped into ``[0, T)`` (invalid sizes fail
    program 0's checks, never an out-of-bounds read)."""
    cj = tl.arange(0, BLOCK_C)
    r = rows.to(tl.int64)[:, None]
    if INVERSE:
        c = tl.sum((end[None, :] <= r).to(tl.int32), axis=1)  # input row i's chunk
        j = tl.sum(tl.where(idx[None, :] == c[:, None], cj[None, :], 0), axis=1)
        inside = c < C
    else:
        j = tl.sum((end[None, :] <= r).to(tl.int32), axis=1)  # output row r's position
        c = tl.sum(tl.where(cj[None, :] == j[:, None], idx_in[None, :], 0), axis=1)
        inside = j < C
    in_start = tl.sum(tl.where(cj[None, :] < c[:, None], sz[None, :], 0), axis=1)
    out_start = tl.sum(tl.where(cj[None, :] < j[:, None], szs[None, :], 0), axis=1)
    if INVERSE:
        src = out_start + rows - in_start
    else:
        src = in_start + rows - out_start
    src = tl.where(inside, src, rows)
    return tl.minimum(tl.maximum(src, 0), T - 1)


@triton.jit
def check_chunks(sizes_ptr, index_ptr, T, C, BLOCK_C: tl.constexpr):
    """Device asserts: the sizes are >= 0 and sum to at most T; the order is a
    permutation of 0..C-1 (sorted, it is 0, 1, ..., C-1)."""
    cj = tl.arange(0, BLOCK_C)
    cm = cj < C
    sz = tl.load(sizes_ptr + cj, mask=cm, other=0).to(tl.int64)
    tl.device_assert(sz >= 0, "qmoe sort_chunks: split_sizes must be >= 0")
    # each size <= T before the sum (the sum of huge sizes would wrap in int64)
    tl.device_assert(sz <= T, "qmoe sort_chunks: split_sizes must sum to at most T")
    tl.device_assert(tl.sum(sz, axis=0) <= T,
                     "qmoe sort_chunks: split_sizes must sum to at most T, the rows of inp")
    idx = tl.load(index_ptr + cj, mask=cm, other=BLOCK_C).to(tl.int64)
    if BLOCK_C > 1:
        srt = tl.sort(idx)
    else:  # one chunk: nothing to sort (Triton 3.5's interpreter fails on a 1-entry sort)
        srt = idx
    ok = (srt == cj.to(tl.int64)) | (cj >= C)  # padding sorts to the end
    tl.device_assert(ok, "qmoe sort_chunks: sorted_index must be a permutation of 0..C-1 "
                     "(each chunk once)")


@triton.jit
def sort_chunks_kernel(
    inp_ptr,  # (T, H) any dtype, row stride stride_in
    out_ptr,  # (T, H) same dtype, contiguous
    sizes_ptr,  # (C,) int split sizes (chunk c: split_sizes[c] rows, in input order)
    index_ptr,  # (C,) int sorted_index (chunk index[j] is emitted j-th)
    p_ptr,  # (T,) float probs, moved alike (read only if HAS_P)
    pp_ptr,  # (T,) probs dtype out (written only if HAS_P)
    side_ptr,  # (T, NS) side rows moved alike, e.g. block scales (read only if HAS_SIDE)
    side_out_ptr,  # (T, NS) side rows out, contiguous (written only if HAS_SIDE)
    T,
    H,
    C,
    NS,
    stride_in,
    stride_side,
    INVERSE: tl.constexpr,  # the inverse movement (the backward)
    CHECK: tl.constexpr,  # program 0 checks the sizes and the order; probs: no NaN
    HAS_P: tl.constexpr,
    HAS_SIDE: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= NS when HAS_SIDE
    SIDE_WIDE: tl.constexpr,  # side tiles [BLOCK_R, BLOCK_H] (BLOCK_H >= NS), see below
    STEPS: tl.constexpr,  # row tiles a program, one after the other
):
    """Grid ``(max(1, cdiv(T, BLOCK_R * STEPS)), cdiv(H, BLOCK_H))``: out[r] = inp[src(r)]
    (``chunk_sources``), probs and side rows alike (by the first column program)."""
    if CHECK:  # noqa: SIM102 - a constexpr branch (pruned at compile) around a runtime one
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            check_chunks(sizes_ptr, index_ptr, T, C, BLOCK_C)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = cols < H
    idx, idx_in, sz, szs, end = chunk_table(sizes_ptr, index_ptr, C, INVERSE, BLOCK_C)
    # The program's first and last row: in one chunk (or both past the chunks), every row
    # reads at the same offset, worked out once here instead of a scan over C a row.
    first = tl.program_id(0) * (STEPS * BLOCK_R)
    ends = first + tl.arange(0, 2) * (tl.maximum(tl.minimum(first + STEPS * BLOCK_R, T) - 1,
                                                  first) - first)  # [2] int32
    pos = tl.sum((end[None, :] <= ends.to(tl.int64)[:, None]).to(tl.int32), axis=1)
    one_chunk = tl.min(pos, axis=0) == tl.max(pos, axis=0)
    delta = tl.sum(tl.where(tl.arange(0, 2) == 0, chunk_sources(
        ends, idx, idx_in, sz, szs, end, T, C, INVERSE, BLOCK_C) - ends, 0), axis=0)
    # side columns: their own [BLOCK_S] range, or (SIDE_WIDE, BLOCK_H >= NS) the rows' own
    # column range, so the side tile shares the rows' layout (only the first column
    # program, where cols = 0..BLOCK_H-1, moves side rows)
    sc = cols if SIDE_WIDE else tl.arange(0, BLOCK_S)
    for step in tl.static_range(STEPS):
        rows = (tl.program_id(0) * STEPS + step) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < T
        if one_chunk:
            src = tl.minimum(tl.maximum(rows.to(tl.int64) + delta, 0), T - 1)
        else:
            src = chunk_sources(rows, idx, idx_in, sz, szs, end, T, C, INVERSE, BLOCK_C)
        # every load before any store, so the stores do not wait on the probs' and side
        # rows' loads (docs/benchmarks.md, "FP8 rows: int32 words, the scan cut, side
        # rows"); those move in the first column program (masked off in the others: no
        # memory traffic)
        m = rmask[:, None] & hmask[None, :]
        x = tl.load(inp_ptr + src[:, None] * stride_in + cols[None, :], mask=m)
        pm = rmask & (tl.zeros_like(rows) + tl.program_id(1) == 0)  # [BLOCK_R]
        if HAS_P:
            pv = tl.load(p_ptr + src, mask=pm, other=0.0)
        if HAS_SIDE:
            sm = pm[:, None] & (sc < NS)[None, :]
            sv = tl.load(side_ptr + src[:, None] * stride_side + sc[None, :], mask=sm)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :], x, mask=m)
        if HAS_P:
            if CHECK:  # (not in the backward: NaN gradients pass through)
                assert_probs_not_nan(pv)
            tl.store(pp_ptr + rows, pv, mask=pm)
        if HAS_SIDE:
            tl.store(side_out_ptr + rows.to(tl.int64)[:, None] * NS + sc[None, :], sv,
                     mask=sm)


@triton.jit
def gather_rows_kernel(
    inp_ptr,  # (R_in, H) any dtype, row stride stride_in
    out_ptr,  # (R, H) same dtype, contiguous
    src_ptr,  # (R,) int64 source row of each output row
    R,
    H,
    stride_in,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """out[r] = inp[src[r]]: each row read once and written once."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    rmask = rows < R
    src = tl.load(src_ptr + rows, mask=rmask, other=0)
    m = rmask[:, None] & (cols < H)[None, :]
    x = tl.load(inp_ptr + src[:, None] * stride_in + cols[None, :], mask=m)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :], x, mask=m)


# ------------------------------------------------------------------------- launchers


def sort_chunks_triton(
    inp: torch.Tensor,
    split_sizes: torch.Tensor,
    sorted_index: torch.Tensor,
    probs: torch.Tensor | None = None,
    side: torch.Tensor | None = None,
    *,
    inverse: bool = False,
    check: bool = True,
    tiling: SortChunksTiling | None = None,
    out: torch.Tensor | None = None,
    side_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H], probs moved alike [T] or empty)``: the chunk sort of ``inp [T, H]``
    by ``split_sizes [C]`` and ``sorted_index [C]`` in one launch: the op's CUDA path up to
    ``MAX_KERNEL_CHUNKS`` chunks, forward and backward. Every program holds the C sizes
    and the order in registers.
    ``inverse``: the movement back (the backward; assumes a valid order). ``check``:
    program 0 asserts on the device that the sizes are >= 0 and sum to at most T and that
    the order is a permutation; moved probs must not be NaN. No host sync.
    ``side [T, NS]`` (the block scales of quantized rows) moves alike into ``side_out``
    (given by the caller) in the same launch (``qmoe::sort_chunks_rows``). ``tiling``
    overrides ``sort_chunks_tile`` and the word moves (``SortChunksTiling``). Byte rows
    (FP8 bits, e8m0 scales) move as int32 words where the layout allows: ``sweep
    sort_chunks --fp8`` (docs/benchmarks.md, "FP8 rows: int32 words, the scan cut, side
    rows"), % of copy, words against bytes: dsv3 blockwise 90.4 vs 72.2, qwen3next MX side
    rows 88.7 vs 73.6. ``out`` (tests: poisoned) receives the rows."""
    o = tiling or _DEFAULTS
    t, h = inp.shape
    c = split_sizes.numel()
    if (side is None) != (side_out is None):
        raise ValueError("sort_chunks_triton: pass side and side_out together")
    for name, x in (("out", out), ("side_out", side_out)):
        if x is not None and not x.is_contiguous():
            raise ValueError(f"sort_chunks_triton: {name} must be contiguous (the kernel "
                             "writes rows at a stride of their width); pass a fresh tensor")
    out = inp.new_empty((t, h)) if out is None else out
    pp = probs.new_empty((t,)) if probs is not None else inp.new_empty(0)
    if c == 0:  # no chunks: every row stays
        out.copy_(inp)
        if side is not None:
            side_out.copy_(side)
        return out, pp.copy_(probs) if probs is not None else pp
    # the kernel steps columns, probs and the chunk tables by 1 (rows by their stride)
    inp, probs = unit_stride(inp), unit_stride(probs)
    split_sizes, sorted_index = split_sizes.contiguous(), sorted_index.contiguous()
    views = _int32_views(inp, out) if o.words else None  # byte rows: 4 bytes a lane
    words = views is not None
    src, dst = views or (inp, out)
    hw = src.shape[1]
    br, bh, steps = sort_chunks_tile(t, hw, src.element_size(), c, words, block_h=o.block_h,
                                     steps=o.steps, max_scan=o.max_scan)
    has_s = side is not None
    side = unit_stride(side)
    if has_s and o.side_words:  # (views of the caller's side_out: written in place)
        side, side_out = _int32_views(side, side_out) or (side, side_out)
    ns = side.shape[1] if has_s else 0
    side_wide = bh <= SIDE_WIDE_MAX_COLS if o.side_wide is None else o.side_wide
    launch(sort_chunks_kernel, (max(1, cdiv(t, br * steps)), cdiv(max(hw, 1), bh)),
        src, dst, split_sizes, sorted_index, probs, pp if probs is not None else None, side,
        side_out if has_s else None, t, hw, c, ns, src.stride(0),
        side.stride(0) if has_s else None, INVERSE=inverse, CHECK=check,
        HAS_P=probs is not None, HAS_SIDE=has_s, BLOCK_C=next_pow2(c), BLOCK_R=br,
        BLOCK_H=bh, BLOCK_S=next_pow2(max(ns, 1)), SIDE_WIDE=side_wide and bh >= ns,
        STEPS=steps, num_warps=o.num_warps or SORT_CHUNKS_WARPS,
        **assert_options(),  # check_chunks, assert_probs_not_nan
    )
    return out, pp


def _int32_views(
    a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(a, b)`` (b shaped as a) viewed as int32 words, or None unless both are 1-byte
    rows that allow it (unit column stride; width, row stride and offset multiples of 4)."""
    h = a.shape[1]
    if a.element_size() != 1 or not all(
            x.stride(1) == 1 and h % 4 == 0 and x.stride(0) % 4 == 0
            and x.storage_offset() % 4 == 0 for x in (a, b)):
        return None
    return a.view(torch.int32), b.view(torch.int32)


def gather_rows_triton(
    x: torch.Tensor, src: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``out[r] = x[src[r]]`` for ``x [T, H]`` and ``src [R]`` int64 (all in range): the
    chunk sort's CUDA path past ``MAX_KERNEL_CHUNKS`` chunks. ``out`` (tests: poisoned)
    receives the rows. No host sync."""
    r, h = src.shape[0], x.shape[1]
    if out is None:
        out = torch.empty(r, h, dtype=x.dtype, device=x.device)
    if r == 0 or h == 0:
        return out
    x, src = unit_stride(x), src.contiguous()
    br, bh, nw = gather_tile(h, x.element_size())
    launch(gather_rows_kernel, (cdiv(r, br), cdiv(h, bh)),
        x, out, src, r, h, x.stride(0), BLOCK_R=br, BLOCK_H=bh, num_warps=nw
    )
    return out

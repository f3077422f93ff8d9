"""Triton code of the chunk sort in one launch (launcher: ``qmoe/ops/sort_chunks.py``).

Glossary: T rows, H hidden, C chunks, BLOCK_C = next_pow2(C), BLOCK_R rows a tile, STEPS
tiles a program.

Every program works out its rows' sources from the C split sizes and the chunk order
itself (one scan over BLOCK_C a program; a few masked sums over BLOCK_C a row only where
the program's rows span two chunks or more, else one offset for all), so the sort needs no
source-row array and no launches of its own for it; program 0 also checks the sizes and
the order with device asserts (launched with ``debug=True``), in place of the op's checks.
"""

import triton
import triton.language as tl

from qmoe.ops._kernels.permute import assert_probs_not_nan


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

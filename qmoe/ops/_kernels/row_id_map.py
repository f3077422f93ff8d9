"""Triton code building the mask-map row_id_map in three launches (no torch ops between).

Glossary: T tokens, E experts, N output rows, NBLK blocks of BLOCK_T tokens (one row of
counts each), processed in tiles of SUB_T tokens, BLOCK_E = next_pow2(E), A the padding
alignment. Launcher: ``qmoe/ops/row_id_map.py``.

1. ``mask_block_counts_kernel``: each block's token count per expert, ``[NBLK, E]``.
2. ``block_scan_kernel``: per expert, the exclusive prefix of those counts over the
   blocks (in place: tokens of earlier blocks on that expert) and the expert's total.
   Programs own a few experts each and walk the blocks, so the pass is parallel.
3. ``mask_row_id_map_kernel``: every program turns the totals into expert starts (padded
   to A, exclusive cumsum over experts: a few hundred adds, cheaper than a launch), ranks
   its tokens inside the block (a cumsum down the tokens), drops rows ``>= N``, and packs
   each token's kept routes to the front of its map row (a cumsum across the experts).
   Program 0 also writes ``fill``, the row ranges no route writes (``row_id_map.py``).
"""

import triton
import triton.language as tl


@triton.jit
def _routed_tile(mask_ptr, row0, T, E, stride_t, SUB_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """Rows ``row0 .. row0 + SUB_T`` of the mask as a ``[SUB_T, BLOCK_E]`` tile: ``(rows,
    cols, in-bounds, routed as int32 0/1)``."""
    rows = row0 + tl.arange(0, SUB_T)
    cols = tl.arange(0, BLOCK_E)
    inb = (rows < T)[:, None] & (cols < E)[None, :]
    m = tl.load(mask_ptr + rows.to(tl.int64)[:, None] * stride_t + cols[None, :], mask=inb, other=0)
    return rows, cols, inb, ((m != 0) & inb).to(tl.int32)


@triton.jit
def mask_block_counts_kernel(
    mask_ptr,  # (T, E) uint8 / int32 / int64, nonzero = routed, row stride stride_t
    counts_ptr,  # (NBLK, E) int32 out
    T,
    E,
    stride_t,
    BLOCK_T: tl.constexpr,  # tokens per block (a row of counts)
    SUB_T: tl.constexpr,  # tokens per tile (BLOCK_T is a multiple)
    BLOCK_E: tl.constexpr,
):
    blk = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    acc = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for t0 in range(0, BLOCK_T, SUB_T):
        _, _, _, mi = _routed_tile(mask_ptr, blk * BLOCK_T + t0, T, E, stride_t, SUB_T, BLOCK_E)
        acc += tl.sum(mi, axis=0)
    tl.store(counts_ptr + blk.to(tl.int64) * E + cols, acc, mask=cols < E)


@triton.jit
def block_scan_kernel(
    counts_ptr,  # (NBLK, E) int32 in: block counts; out: counts of earlier blocks
    total_ptr,  # (E,) int32 out: tokens per expert
    NBLK,
    E,
    CHUNK_B: tl.constexpr,  # blocks per step
    COLS: tl.constexpr,  # experts per program
):
    cols = tl.program_id(0) * COLS + tl.arange(0, COLS)
    cmask = cols < E
    run = tl.zeros((COLS,), dtype=tl.int32)
    for b0 in range(0, NBLK, CHUNK_B):
        b = b0 + tl.arange(0, CHUNK_B)
        m = (b < NBLK)[:, None] & cmask[None, :]
        ptr = counts_ptr + b.to(tl.int64)[:, None] * E + cols[None, :]
        c = tl.load(ptr, mask=m, other=0)
        tl.store(ptr, tl.cumsum(c, axis=0) - c + run[None, :], mask=m)
        run += tl.sum(c, axis=0)
    tl.store(total_ptr + cols, run, mask=cmask)


@triton.jit
def mask_row_id_map_kernel(
    mask_ptr,  # (T, E) uint8 / int32 / int64, row stride stride_t
    before_ptr,  # (NBLK, E) int32: tokens of earlier blocks, per expert
    total_ptr,  # (E,) int32: tokens per expert
    map_ptr,  # (T, 2E+1) int32 out
    fill_ptr,  # (E+1, 2) int32 out if A > 1, else (1, 2): row ranges no route writes
    T,
    E,
    N,
    A,
    stride_t,
    BLOCK_T: tl.constexpr,  # tokens per block, as in mask_block_counts_kernel
    SUB_T: tl.constexpr,  # tokens per tile
    BLOCK_E: tl.constexpr,
    PREFILLED: tl.constexpr,  # the map arrives filled with -1: write the kept entries only
):
    blk = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    cmask = cols < E
    total = tl.load(total_ptr + cols, mask=cmask, other=0)
    padded = (total + (A - 1)) // A * A
    start = tl.cumsum(padded, axis=0) - padded
    # the next row of each expert: its start plus the tokens of earlier blocks and tiles
    run = start + tl.load(before_ptr + blk.to(tl.int64) * E + cols, mask=cmask, other=0)
    width = 2 * E + 1
    minus1 = tl.full((SUB_T, BLOCK_E), -1, dtype=tl.int32)
    for t0 in range(0, BLOCK_T, SUB_T):
        rows, cols2, inb, mi = _routed_tile(mask_ptr, blk * BLOCK_T + t0, T, E, stride_t, SUB_T,
                                            BLOCK_E)
        rank = tl.cumsum(mi, axis=0) - mi  # earlier tokens of this tile on the same expert
        dst = run[None, :] + rank
        run += tl.sum(mi, axis=0)
        keep = (mi != 0) & (dst < N)
        ki = keep.to(tl.int32)
        slot = tl.cumsum(ki, axis=1) - ki  # position among the token's kept routes
        n = tl.sum(ki, axis=1)
        rowp = map_ptr + rows.to(tl.int64)[:, None] * width
        colsb = cols2[None, :] + tl.zeros((SUB_T, BLOCK_E), dtype=tl.int32)
        tl.store(rowp + slot, dst, mask=keep)
        tl.store(rowp + E + slot, colsb, mask=keep)
        if not PREFILLED:
            fill = inb & (colsb >= n[:, None])
            tl.store(rowp + colsb, minus1, mask=fill)
            tl.store(rowp + E + colsb, minus1, mask=fill)
        tl.store(map_ptr + rows.to(tl.int64) * width + 2 * E, n, mask=rows < T)
    if blk == 0:  # fill: after each expert's rows its padding, then the tail (clipped to N)
        ranges = E * (A > 1)  # one range per expert, padded maps only
        tl.store(fill_ptr + 2 * cols, tl.minimum(start + total, N), mask=cols < ranges)
        tl.store(fill_ptr + 2 * cols + 1, tl.minimum(start + padded, N), mask=cols < ranges)
        tail = 2 * ranges  # then the tail, past the (padded) total
        tl.store(fill_ptr + tail, tl.minimum(tl.sum(padded, axis=0), N))
        tl.store(fill_ptr + tail + 1, N)

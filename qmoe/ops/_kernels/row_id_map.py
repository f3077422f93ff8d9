"""Triton code building the mask-map row_id_map in two linear passes over the mask.

Glossary: T tokens, E experts, N output rows, BLOCK_T tokens per program,
BLOCK_E = next_pow2(E). Launcher: ``qmoe/ops/row_id_map.py``.

Pass 1 counts each expert's tokens per block of BLOCK_T tokens. Between the passes,
torch turns the ``[NBLK, E]`` counts into each block's first row per expert (expert
starts, padded if asked, plus the counts of earlier blocks). Pass 2 ranks tokens inside
the block (a cumsum down the tokens), drops rows ``>= N``, and packs each token's kept
routes to the front of its map row (a cumsum across the experts).
"""

import triton
import triton.language as tl


@triton.jit
def mask_block_counts_kernel(
    mask_ptr,  # (T, E) uint8 / int32 / int64, nonzero = routed, row stride stride_t
    counts_ptr,  # (NBLK, E) int32 out
    T,
    E,
    stride_t,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    blk = tl.program_id(0)
    rows = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    inb = (rows < T)[:, None] & (cols < E)[None, :]
    m = tl.load(mask_ptr + rows.to(tl.int64)[:, None] * stride_t + cols[None, :], mask=inb, other=0)
    c = tl.sum((m != 0).to(tl.int32), axis=0)
    tl.store(counts_ptr + blk * E + cols, c, mask=cols < E)


@triton.jit
def mask_row_id_map_kernel(
    mask_ptr,  # (T, E) uint8 / int32 / int64, row stride stride_t
    base_ptr,  # (NBLK, E) int32: first output row of this block's tokens, per expert
    map_ptr,  # (T, 2E+1) int32 out
    T,
    E,
    N,
    stride_t,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    blk = tl.program_id(0)
    rows = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    rmask = rows < T
    inb = rmask[:, None] & (cols < E)[None, :]
    m = tl.load(mask_ptr + rows.to(tl.int64)[:, None] * stride_t + cols[None, :], mask=inb, other=0)
    mi = ((m != 0) & inb).to(tl.int32)
    rank = tl.cumsum(mi, axis=0) - mi  # earlier tokens of this block on the same expert
    base = tl.load(base_ptr + blk * E + cols, mask=cols < E, other=0)
    dst = base[None, :] + rank
    keep = (mi != 0) & (dst < N)
    ki = keep.to(tl.int32)
    slot = tl.cumsum(ki, axis=1) - ki  # position among the token's kept routes
    n = tl.sum(ki, axis=1)
    width = 2 * E + 1
    rowp = map_ptr + rows.to(tl.int64)[:, None] * width
    colsb = cols[None, :] + tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int32)
    tl.store(rowp + slot, dst, mask=keep)
    tl.store(rowp + E + slot, colsb, mask=keep)
    fill = inb & (colsb >= n[:, None])
    minus1 = tl.full((BLOCK_T, BLOCK_E), -1, dtype=tl.int32)
    tl.store(rowp + colsb, minus1, mask=fill)
    tl.store(rowp + E + colsb, minus1, mask=fill)
    tl.store(map_ptr + rows.to(tl.int64) * width + 2 * E, n, mask=rmask)

"""Triton code building the mask-map row_id_map in three launches, or one for small masks.

Glossary: T tokens, E experts, N output rows, NBLK blocks of BLOCK_T tokens (one row of
counts each), BLOCK_E = next_pow2(E), A the padding alignment. Both mask passes walk a
block one token row at a time, as 1D ``[BLOCK_E]`` vectors in an unrolled loop. The count
pass only adds rows (its loads issue together; no cross-thread step). The map pass keeps
each expert's running count in registers (a token's rank inside the block needs no scan
down the tokens), loads PREFETCH rows ahead, and per row does one scan and one sum across
the row's experts.

1. ``mask_block_counts_kernel``: each block's token count per expert, ``[NBLK, E]``.
2. ``block_scan_kernel``: per expert, the exclusive prefix of those counts over the
   blocks (in place: tokens of earlier blocks on that expert) and the expert's total.
   Programs own a few experts each and walk the blocks, so the pass is parallel.
3. ``mask_row_id_map_kernel``: every program turns the totals into expert starts (padded
   to A, exclusive cumsum over experts: a few hundred adds, cheaper than a launch), ranks
   its tokens inside the block (the running count), drops rows ``>= N``, and packs
   each token's kept routes to the front of its map row (a cumsum across the experts).
   Program 0 also writes ``fill``, the row ranges no route writes (``row_id_map.py``).

Small masks (a few tens of KB) take one launch instead of three:
``mask_row_id_map_small_kernel`` has every program count the whole mask itself (passes 1
and 2 done redundantly, per program), then map its block as pass 3 does. At that size the
host cost of a launch (tens of microseconds) outweighs the redundant reads. Small index
maps likewise take one launch (``index_row_id_map_small_kernel``, counting ranks instead
of sorting); larger ones are built with torch sorts (``row_id_map.py``).

Launchers (at the end): ``block_counts`` / ``index_block_counts`` (passes 1 and 2, also
used by the fused permutes), ``mask_rows_triton`` and ``index_rows_triton``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qmoe._intmath import cdiv, next_pow2
from qmoe._triton import launch
from qmoe.ops.launch import ID_LIMIT, assert_options, mask_operand, pdl_options, unit_stride
from qmoe.ops.tuning import (
    MaskMapTiling,
    map_tiling,
    scan_tile,
    small_index_tile,
    small_map_walk,
    small_mask,
)

#: no overrides: the defaults (frozen, so one instance serves every call)
_DEFAULTS = MaskMapTiling()


@triton.jit
def mask_row(mask_ptr, t, T, E, stride_t, cols):
    """Token t's mask row as int32 0/1 over ``cols`` (zeros past E or when t >= T)."""
    width = tl.where(t < T, E, 0)  # one compare per entry: past T the row is empty
    m = tl.load(mask_ptr + t.to(tl.int64) * stride_t + cols, mask=cols < width, other=0)
    return (m != 0).to(tl.int32)


@triton.jit
def mask_block_counts_kernel(
    mask_ptr,  # (T, E) any integer dtype (bool as uint8), nonzero = routed, row stride stride_t
    counts_ptr,  # (NBLK, E) int32 out
    T,
    E,
    stride_t,
    BLOCK_T: tl.constexpr,  # tokens per block (a row of counts)
    BLOCK_E: tl.constexpr,
    PDL: tl.constexpr,  # let the scan launch now (it waits for this grid's end itself)
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    blk = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    acc = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for i in tl.static_range(BLOCK_T):  # unrolled: the row loads issue together
        acc += mask_row(mask_ptr, blk * BLOCK_T + i, T, E, stride_t, cols)
    tl.store(counts_ptr + blk.to(tl.int64) * E + cols, acc, mask=cols < E)


@triton.jit
def index_row(ids_ptr, t, T, K, stride_t, lanes):
    """Token t's expert ids over ``lanes`` (``[BLOCK_K]``, in the map's own integer type:
    no narrowing before they are checked): ``-1`` past K or when t >= T (and wherever the
    map says not routed)."""
    width = tl.where(t < T, K, 0)
    return tl.load(ids_ptr + t.to(tl.int64) * stride_t + lanes, mask=lanes < width, other=-1)


@triton.jit
def id_counts(ids, cols):
    """``[BLOCK_E]`` int32: how many of ``ids`` (``[BLOCK_K]``) name each expert in
    ``cols`` (negative ids name none)."""
    return tl.sum((ids[:, None] == cols[None, :]).to(tl.int32), axis=0)


@triton.jit
def index_block_counts_kernel(
    ids_ptr,  # (T, K) int8/16/32/64 expert ids in [-1, E), row stride stride_t
    counts_ptr,  # (NBLK, E) int32 out
    T,
    K,
    E,
    stride_t,
    BLOCK_T: tl.constexpr,  # tokens per block (a row of counts)
    BLOCK_K: tl.constexpr,  # next_pow2(K)
    BLOCK_E: tl.constexpr,
    PDL: tl.constexpr,  # let the scan launch now (it waits for this grid's end itself)
):
    """``mask_block_counts_kernel`` for an index map: each block's routes per expert."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    blk = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for i in tl.static_range(BLOCK_T):
        acc += id_counts(index_row(ids_ptr, blk * BLOCK_T + i, T, K, stride_t, lanes), cols)
    tl.store(counts_ptr + blk.to(tl.int64) * E + cols, acc, mask=cols < E)


@triton.jit
def block_scan_kernel(
    counts_ptr,  # (NBLK, E) int32 in: block counts; out: counts of earlier blocks
    total_ptr,  # (E,) int32 out: tokens per expert
    NBLK,
    E,
    CHUNK_B: tl.constexpr,  # blocks per step
    COLS: tl.constexpr,  # experts per program
    PDL: tl.constexpr,  # launched as a programmatic dependent of the count pass
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the fused kernel may launch, load its rows
        tl.extra.cuda.gdc_wait()  # the count pass has ended and its counts are visible
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
    mask_ptr,  # (T, E) any integer dtype (bool as uint8), row stride stride_t
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
    BLOCK_E: tl.constexpr,
    PREFETCH: tl.constexpr,  # rows loaded ahead of the one being worked on (1..BLOCK_T)
    PDL: tl.constexpr,  # launched as a programmatic dependent of the scan
):
    if PDL:
        tl.extra.cuda.gdc_wait()  # the scan has ended and its counts are visible
    blk = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    cmask = cols < E
    total = tl.load(total_ptr + cols, mask=cmask, other=0)
    before = tl.load(before_ptr + blk.to(tl.int64) * E + cols, mask=cmask, other=0)
    _map_block(mask_ptr, map_ptr, fill_ptr, blk, total, before, T, E, N, A, stride_t, cols,
               BLOCK_T, BLOCK_E, PREFETCH)


@triton.jit
def mask_row_id_map_small_kernel(
    mask_ptr,  # (T, E) any integer dtype (bool as uint8), row stride stride_t
    map_ptr,  # (T, 2E+1) int32 out
    fill_ptr,  # (E+1, 2) int32 out if A > 1, else (1, 2): row ranges no route writes
    T,
    E,
    N,
    A,
    stride_t,
    BLOCK_T: tl.constexpr,  # tokens per block
    BLOCK_E: tl.constexpr,
    CHUNK_T: tl.constexpr,  # mask rows per step of the counting walk
    PREFETCH: tl.constexpr,
):
    """The whole map in one launch, for small masks: every program counts the full mask
    itself (per expert: all tokens, and the tokens before its block), then maps its
    block as ``mask_row_id_map_kernel`` does. Each program reads T*E entries, so the
    launcher uses it only while that is a few tens of KB (launch overhead dominates)."""
    blk = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    total, before = count_mask(mask_ptr, T, E, stride_t, blk * BLOCK_T, cols, CHUNK_T)
    _map_block(mask_ptr, map_ptr, fill_ptr, blk, total, before, T, E, N, A, stride_t, cols,
               BLOCK_T, BLOCK_E, PREFETCH)


@triton.jit
def count_mask(mask_ptr, T, E, stride_t, below, cols, CHUNK_T: tl.constexpr):
    """``(total, before)``, ``[BLOCK_E]`` int32 over ``cols`` (zero past E): each
    expert's tokens in the whole ``[T, E]`` mask, and among the tokens ``< below``. Walks
    all T rows, ``CHUNK_T`` a step."""
    cmask = cols < E
    rows = tl.arange(0, CHUNK_T)
    total = tl.zeros(cols.shape, dtype=tl.int32)
    before = tl.zeros(cols.shape, dtype=tl.int32)
    for c0 in range(0, T, CHUNK_T):
        t = c0 + rows
        m = tl.load(mask_ptr + t.to(tl.int64)[:, None] * stride_t + cols[None, :],
                    mask=(t < T)[:, None] & cmask[None, :], other=0)
        mi = (m != 0).to(tl.int32)
        total += tl.sum(mi, axis=0)
        before += tl.sum(tl.where((t < below)[:, None], mi, 0), axis=0)
    return total, before


@triton.jit
def expert_starts(total, A):
    """``(start, padded)``: each expert's first output row (the padded rows of lower
    experts) and its row count padded to a multiple of A, from ``total`` (tokens per
    expert, zero past E)."""
    padded = (total + (A - 1)) // A * A
    return tl.cumsum(padded, axis=0) - padded, padded


@triton.jit
def _map_block(mask_ptr, map_ptr, fill_ptr, blk, total, before, T, E, N, A, stride_t, cols,
               BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, PREFETCH: tl.constexpr):
    """Block ``blk``'s map rows from ``total`` (tokens per expert) and ``before`` (tokens
    of earlier blocks per expert), both ``[BLOCK_E]`` int32 (zero past E); block 0 also
    writes ``fill`` (arguments as in ``mask_row_id_map_kernel``)."""
    cmask = cols < E
    start, padded = expert_starts(total, A)
    # the next row of each expert: its start plus the tokens of earlier blocks and rows
    run = start + before
    width = 2 * E + 1
    minus1 = tl.full((BLOCK_E,), -1, dtype=tl.int32)
    t0 = blk * BLOCK_T
    # Load PREFETCH rows ahead of the work (the scans' barriers keep the compiler from
    # hoisting loads, so each row would otherwise wait a full memory round trip).
    ahead = ()
    for i in tl.static_range(PREFETCH):
        ahead = ahead + (mask_row(mask_ptr, t0 + i, T, E, stride_t, cols),)
    for i in tl.static_range(BLOCK_T):
        t = t0 + i
        mi = ahead[i]
        if i + PREFETCH < BLOCK_T:
            ahead = ahead + (mask_row(mask_ptr, t0 + i + PREFETCH, T, E, stride_t, cols),)
        keep = (mi != 0) & (run < N)
        ki = keep.to(tl.int32)
        slot = tl.cumsum(ki, axis=0) - ki  # position among the token's kept routes
        n = tl.sum(ki, axis=0)
        if t < T:
            write_map_row(map_ptr + t.to(tl.int64) * width, E, cols, cmask, slot, run, cols,
                           keep, n, minus1)
        run += mi
    if blk == 0:  # fill: after each expert's rows its padding, then the tail (clipped to N)
        ranges = E * (A > 1)  # one range per expert, padded maps only
        tl.store(fill_ptr + 2 * cols, tl.minimum(start + total, N), mask=cols < ranges)
        tl.store(fill_ptr + 2 * cols + 1, tl.minimum(start + padded, N), mask=cols < ranges)
        tail = 2 * ranges  # then the tail, past the (padded) total
        tl.store(fill_ptr + tail, tl.minimum(tl.sum(padded, axis=0), N))
        tl.store(fill_ptr + tail + 1, N)


@triton.jit
def write_map_row(rowp, S, lanes, lmask, slot, rows, cols, keep, n, minus1):
    """One token's map row at ``rowp`` (``2*S + 1`` int32, format in ``row_id_map.py``):
    each kept lane's output row and probs column at its ``slot`` (the lanes' positions
    among the kept routes), ``-1`` in the entries past the ``n`` kept routes, then ``n``.
    ``lanes`` are ``0..S-1`` (``lmask``: inside S); ``minus1`` is a ``-1`` vector of their
    shape."""
    tl.store(rowp + slot, rows, mask=keep)
    tl.store(rowp + S + slot, cols, mask=keep)
    rest = lmask & (lanes >= n)
    tl.store(rowp + lanes, minus1, mask=rest)
    tl.store(rowp + S + lanes, minus1, mask=rest)
    tl.store(rowp + 2 * S, n)


@triton.jit
def index_row_id_map_small_kernel(
    ids_ptr,  # (T, K) int8/16/32/64 expert ids (negative: not routed), row stride stride_t
    map_ptr,  # (T, 2K+1) int32 out
    fill_ptr,  # (1, 2) int32 out: [routed count clipped to N, N)
    T,
    K,
    N,
    HI,  # ids must be below this: num_experts, or 2**31 - 1 when E is not known
    stride_t,
    BLOCK_K: tl.constexpr,  # next_pow2(K)
    CHUNK: tl.constexpr,  # (token, slot) entries compared per step
):
    """The index map of a small ``[T, K]`` id matrix in one launch, one program per token,
    without a sort and without knowing E: the row of route (t, k) is its rank in the order
    (expert, token, slot) among routed entries, i.e. the routed entries with a lower
    expert, or the same expert and an earlier flattened position ``t*K + k``. Every
    program counts those over all T*K entries itself (T*K*K compares), so the launcher
    uses it only for a few thousand entries. Ranks ``>= N`` are dropped; kept routes are
    packed to the front of the map row in row order, with their slot k as the column.
    Each program asserts its token's ids are in ``[-1, HI)`` (before the narrowing to
    int32): the public ops' id check on this path, without aten launches."""
    t = tl.program_id(0)
    ks = tl.arange(0, BLOCK_K)
    kmask = ks < K
    raw = tl.load(ids_ptr + t.to(tl.int64) * stride_t + ks, mask=kmask, other=-1)
    wide = raw.to(tl.int64)  # (compared wide: uint8 ids and int64 ids past 2**31 alike)
    tl.device_assert((wide >= -1) & (wide < HI),
                     "qmoe: routing_map ids must be >= -1 and < num_experts (below 2**31 - 1 "
                     "without num_experts: renumber the experts to [0, E))")
    e = wide.to(tl.int32)
    routed = kmask & (e >= 0)
    p = t * K + ks
    rank = tl.zeros((BLOCK_K,), dtype=tl.int32)
    total = tl.zeros((CHUNK,), dtype=tl.int32)
    q0 = tl.arange(0, CHUNK)
    for c0 in range(0, T * K, CHUNK):
        q = c0 + q0
        tq = q // K
        eq = tl.load(ids_ptr + tq.to(tl.int64) * stride_t + (q - tq * K), mask=q < T * K,
                     other=-1).to(tl.int32)
        rq = eq >= 0
        same = (eq[None, :] == e[:, None]) & (q[None, :] < p[:, None])
        lower = (eq[None, :] < e[:, None]) | same
        rank += tl.sum((rq[None, :] & lower).to(tl.int32), axis=1)
        total += rq.to(tl.int32)
    keep = routed & (rank < N)
    # position among the kept routes: the kept routes of lower rank (ranks are distinct)
    earlier = keep[None, :] & (rank[None, :] < rank[:, None])
    slot = tl.sum(earlier.to(tl.int32), axis=1)
    n = tl.sum(keep.to(tl.int32), axis=0)
    write_map_row(map_ptr + t.to(tl.int64) * (2 * K + 1), K, ks, kmask, slot, rank, ks, keep,
                   n, tl.full((BLOCK_K,), -1, dtype=tl.int32))
    if t == 0:
        tl.store(fill_ptr, tl.minimum(tl.sum(total, axis=0), N))
        tl.store(fill_ptr + 1, N)


# ------------------------------------------------------------------------- launchers


def block_counts(m: torch.Tensor, block_t: int, num_warps: int, pdl: bool = False):
    """``(before [cdiv(T, block_t), E], total [E])`` int32 of a mask ``m [T, E]`` (from
    ``mask_operand``) in two launches: each block's tokens per expert, then their exclusive
    prefix over the blocks (tokens of earlier blocks) and each expert's total. ``pdl``
    (Hopper): the scan launches as a programmatic dependent of the count pass and lets the
    next launch (a fused kernel with ``launch_pdl=True``, which must ``gdc_wait`` before
    reading these) start early; the count pass itself launches in stream order."""
    t, e = m.shape
    nblk = cdiv(t, block_t)
    before = m.new_empty((nblk, e), dtype=torch.int32)
    total = m.new_empty((e,), dtype=torch.int32)
    launch(mask_block_counts_kernel, (nblk,), m, before, t, e, m.stride(0), BLOCK_T=block_t,
                                      BLOCK_E=next_pow2(e), PDL=pdl, num_warps=num_warps)
    _scan_block_counts(before, total, pdl)
    return before, total


def index_block_counts(ids: torch.Tensor, e: int, block_t: int, num_warps: int,
                       pdl: bool = False):
    """``block_counts`` of an index map ``ids [T, K]`` (ids in ``[-1, e)``, unit column
    stride): routes per expert of each block, then their scan and each expert's total."""
    t, k = ids.shape
    nblk = cdiv(t, block_t)
    before = ids.new_empty((nblk, e), dtype=torch.int32)
    total = ids.new_empty((e,), dtype=torch.int32)
    launch(index_block_counts_kernel, (nblk,), ids, before, t, k, e, ids.stride(0), BLOCK_T=block_t,
                                       BLOCK_K=next_pow2(k), BLOCK_E=next_pow2(e), PDL=pdl,
                                       num_warps=num_warps)
    _scan_block_counts(before, total, pdl)
    return before, total


def _scan_block_counts(before: torch.Tensor, total: torch.Tensor, pdl: bool) -> None:
    """The scan launch of ``block_counts``: ``before [NBLK, E]`` in place to the counts of
    earlier blocks, ``total [E]`` the sums."""
    nblk, e = before.shape
    cols, chunk = scan_tile(nblk, e)
    launch(block_scan_kernel, (cdiv(e, cols),), before, total, nblk, e, CHUNK_B=chunk, COLS=cols,
                                        PDL=pdl, **pdl_options(pdl))


def mask_rows_triton(
    routing_map: torch.Tensor,
    num_out_tokens: int,
    align_size: int,
    fill: torch.Tensor,
    tiling: MaskMapTiling | None = None,
) -> torch.Tensor:
    """``row_id_map [T, 2E+1]`` int32 of a mask ``[T, E]``, writing ``fill``
    (``[R, 2]`` int32, allocated by the caller: ``launch.fill_count`` rows) in the same
    launches: three (counts, scan, map), or one for masks of at most ``SMALL_MAP_BYTES``.
    ``tiling`` overrides ``map_tiling`` and the form (tests shrink the blocks to reach many
    with small inputs; the sweep tries others). PDL stays off by default: ``python -m
    benchmarks sweep map --pdl 0,1`` on the H200 (docs/benchmarks.md, "Mask map
    (`make_row_id_map`, `map_tiling`)"): 0.5-1.9 us faster at dsv3, qwen3next and mixtral,
    twice as slow at qwen3 and gptoss (one-warp map programs); unlike the fused kernels,
    the map pass has no loads to issue before its wait. No host sync."""
    t, e = routing_map.shape
    if t == 0 or e == 0:  # no routes: empty map rows; every row of the output unwritten
        rid = routing_map.new_full((t, 2 * e + 1), -1, dtype=torch.int32)
        rid[:, -1] = 0
        fill.zero_()[-1, 1] = num_out_tokens
        return rid
    o = tiling or _DEFAULTS
    d = map_tiling(t, e)
    bt, nw, pf = (d_ if v is None else v for v, d_ in
                  ((o.block_t, d.block_t), (o.num_warps, d.num_warps), (o.prefetch, d.prefetch)))
    if bt < 1 or pf < 1 or nw < 1 or nw & (nw - 1):
        raise ValueError(f"map tiling {tiling}: block_t and prefetch must be >= 1 and "
                         "num_warps a power of two")
    rid = routing_map.new_empty((t, 2 * e + 1), dtype=torch.int32)
    m = mask_operand(routing_map)
    be = next_pow2(e)
    nblk = cdiv(t, bt)
    a = max(align_size, 1)
    if o.one_launch if o.one_launch is not None else small_mask(m):
        chunk, small_warps = small_map_walk(t, be, nw)
        launch(mask_row_id_map_small_kernel, (nblk,),
            m, rid, fill, t, e, num_out_tokens, a, m.stride(0), BLOCK_T=bt, BLOCK_E=be,
            CHUNK_T=chunk, PREFETCH=min(pf, bt), num_warps=small_warps,
        )
        return rid
    counts, total = block_counts(m, bt, nw, o.pdl)
    launch(mask_row_id_map_kernel, (nblk,),
        m, counts, total, rid, fill, t, e, num_out_tokens, a, m.stride(0),
        BLOCK_T=bt, BLOCK_E=be, PREFETCH=min(pf, bt), PDL=o.pdl, num_warps=nw,
        **pdl_options(o.pdl),
    )
    return rid


def index_rows_triton(routing_map: torch.Tensor, num_out_tokens: int,
                      num_experts: int | None = None):
    """``(row_id_map [T, 2K+1], fill [1, 2])`` int32 of a small index map ``[T, K]`` in one
    launch (``tuning.small_index_map``); equal to the sorting build's. Ids outside
    ``[-1, min(num_experts, 2**31 - 1))`` (``[-1, 2**31 - 1)`` when None) trip a device
    assert. No host sync."""
    t, k = routing_map.shape
    ids = unit_stride(routing_map)
    rid = ids.new_empty((t, 2 * k + 1), dtype=torch.int32)
    fill = rid.new_empty((1, 2))
    chunk, nw = small_index_tile(t, k)
    launch(index_row_id_map_small_kernel, (t,),
        ids, rid, fill, t, k, num_out_tokens,
        ID_LIMIT if num_experts is None else min(num_experts, ID_LIMIT), ids.stride(0),
        BLOCK_K=next_pow2(k),
        CHUNK=chunk, num_warps=nw, **assert_options(),  # the id check
    )
    return rid, fill

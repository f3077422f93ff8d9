"""Triton code of the index-map permute that builds its map rows in the scatter launch
and its launcher ``permute_index_triton`` (the CUDA kernel of ``qmoe::permute_index``
where it wins: ``tuning.fused_index_wins``), the index-map counterpart of
``permute_mask_kernel``.

Glossary: T tokens, K slots per token, E experts (known: ``num_experts``), H hidden, N
output rows, NS side-row columns (block scales), BLOCK_T tokens per block of the count pass
(one row of per-expert counts), BLOCK_K = next_pow2(K), BLOCK_E = next_pow2(E), Z programs
sharing the tail of unwritten rows.

The row of route (t, k) is its rank in (expert, token, slot) order among routed entries,
as the sorting path ``row_id_map._index_rows`` defines it: ``start[e]`` (routes of lower
experts) + the routes to e of earlier tokens (the scanned block counts of
``index_block_counts_kernel`` + ``block_scan_kernel``, then the earlier tokens of t's own
block) + the earlier slots of t naming e. So, as in the mask kernel, every token program
builds its own map row and moves its data row to the rows it holds in registers. Unlike
the mask kernel it works per route (``[BLOCK_K]`` vectors: the ids of each earlier token
of the block are compared with the token's, K x K compares) rather than per expert. With
PDL the programs load their data rows before waiting for the scan (``gdc_wait``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qmoe._intmath import cdiv, next_pow2
from qmoe._triton import launch
from qmoe.ops.kernels.permute import store_routes, zero_rows
from qmoe.ops.kernels.permute_mask import fused_outputs, no_routes, routes_at, unwritten_range
from qmoe.ops.kernels.row_id_map import index_block_counts, index_row, write_map_row
from qmoe.ops.launch import assert_options, pdl_default, pdl_options, unit_stride
from qmoe.ops.tuning import (
    FUSED_INDEX_BLOCK_T,
    FUSED_INDEX_WARPS,
    PermuteIndexTiling,
    map_tiling,
    scatter_tile,
    tail_programs,
)

#: no overrides: the defaults (frozen, so one instance serves every call)
_DEFAULTS = PermuteIndexTiling()


@triton.jit
def permute_index_kernel(
    inp_ptr,  # (T, H) any dtype, row stride stride_in
    out_ptr,  # (N, H) same dtype, contiguous
    ids_ptr,  # (T, K) int8/16/32/64 expert ids in [-1, E), -1 = not routed, row stride stride_i
    before_ptr,  # (cdiv(T, BLOCK_T), E) int32: routes of earlier blocks per expert
    total_ptr,  # (E,) int32: routes per expert
    map_ptr,  # (T, 2K+1) int32 out: the row_id_map
    p_ptr,  # (T, K) float probs, row stride stride_p (read only if HAS_P)
    pp_ptr,  # (N,) probs dtype out: the permuted probs (written only if HAS_P)
    side_ptr,  # (T, NS) side rows moved with the data, row stride stride_side (if HAS_SIDE)
    side_out_ptr,  # (N, NS) side rows out, contiguous (written only if HAS_SIDE)
    T,
    N,
    H,
    K,
    E,
    NS,
    Z,
    stride_in,
    stride_i,
    stride_p,
    stride_side,
    HAS_P: tl.constexpr,
    HAS_SIDE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    KB: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent of the scan
):
    """Grid ``(T + Z, cdiv(H, BLOCK_H))``: program t < T maps token t and moves its row
    (column-block 0 writes the map row); the last Z programs zero the rows past the routed
    count."""
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = cols < H
    if pid < T:
        t = pid.to(tl.int64)
        x = tl.load(inp_ptr + t * stride_in + cols, mask=hmask)  # in flight during the map
        if PDL:  # the scan's counts are read from here on
            tl.extra.cuda.gdc_wait()
        ce = tl.arange(0, BLOCK_E)
        lanes = tl.arange(0, BLOCK_K)
        ids = index_row(ids_ptr, pid, T, K, stride_i, lanes)
        tl.device_assert((ids < E) & (ids >= -1),
                         "qmoe: routing_map ids must be in [-1, num_experts)")
        valid = ids >= 0
        # Each route's row, worked out for its own expert only ([BLOCK_K] vectors; no
        # [BLOCK_E]-wide running count): the routes of lower experts (from the totals),
        # of earlier blocks (a gather from the scanned counts), of the block's earlier
        # tokens (their ids compared with the route's) and of t's earlier slots.
        total = tl.load(total_ptr + ce, mask=ce < E, other=0)
        rows = tl.sum(tl.where(ce[None, :] < ids[:, None], total[None, :], 0), axis=1)
        blk = pid // BLOCK_T
        rows += tl.load(before_ptr + blk.to(tl.int64) * E + ids, mask=valid & (ids < E),
                        other=0)
        for i in tl.static_range(BLOCK_T - 1):  # the block's tokens before t
            tt = blk * BLOCK_T + i
            prev = index_row(ids_ptr, tt, tl.where(tt < pid, T, 0), K, stride_i, lanes)
            rows += tl.sum((prev[None, :] == ids[:, None]).to(tl.int32), axis=1)
        same = (ids[None, :] == ids[:, None]) & (lanes[None, :] < lanes[:, None])  # k' < k
        rows += tl.sum(same.to(tl.int32), axis=1)  # earlier slots naming the same expert
        keep = valid & (rows < N)
        before_k = keep[None, :] & (rows[None, :] < rows[:, None])  # kept routes before k
        slot = tl.sum(before_k.to(tl.int32), axis=1)  # position among the kept, row order
        n = tl.sum(keep.to(tl.int32), axis=0)
        if tl.program_id(1) == 0:
            write_map_row(map_ptr + t * (2 * K + 1), K, lanes, lanes < K, slot, rows, lanes,
                          keep, n, tl.full((BLOCK_K,), -1, dtype=tl.int32))
        for s0 in range(0, n, KB):
            d, c, smask = routes_at(keep, slot, rows, s0, n, BLOCK_K, KB)
            store_routes(t, x, d, c, smask, out_ptr, None, None, p_ptr, pp_ptr, side_ptr,
                         side_out_ptr, NS, H, cols, hmask, 0, stride_p, stride_side, False,
                         HAS_P, HAS_SIDE, False, KB, BLOCK_H, BLOCK_S)
    else:
        if PDL:
            tl.extra.cuda.gdc_wait()
        # the tail past the routed count (no padding: A = 1), as in the mask kernel
        lo, hi = unwritten_range(pid - T, ids_ptr, total_ptr, T, N, E, 1, Z, stride_i, False,
                                 BLOCK_E, 1)
        sc = tl.arange(0, BLOCK_S)
        first = tl.program_id(1) == 0
        zero_rows(lo, hi, N, out_ptr, H, cols, hmask, side_out_ptr, NS, sc,
                  sc < tl.where(first, NS, 0), pp_ptr, first, HAS_SIDE, HAS_P)


# -------------------------------------------------------------------------- launcher


def permute_index_triton(
    x: torch.Tensor,
    ids: torch.Tensor,
    n: int,
    num_experts: int,
    probs: torch.Tensor | None = None,
    side: torch.Tensor | None = None,
    tiling: PermuteIndexTiling | None = None,
    *,
    out: torch.Tensor | None = None,
):
    """``(out [N, H], permuted_probs [N] or None, side_out [N, NS] or None, row_id_map
    [T, 2K+1] int32)`` of ``x [T, H]`` by the index map ``ids [T, K]`` (expert ids in
    ``[-1, num_experts)``, ``-1`` not routed; an id outside fails a device assert, the
    public ops' id check on this path), with ``probs [T, K]`` and side rows ``[T, NS]`` moved
    alike: as ``make_row_id_map(ids, N, True, 1)`` then the scatter, bit for bit. ``tiling``
    overrides the count block, warps and PDL (``PermuteIndexTiling``); ``out`` (tests:
    poisoned) receives the rows. Three launches, no host sync."""
    o = tiling or _DEFAULTS
    t, h = x.shape
    k = ids.shape[1]
    e = num_experts
    if e < 1:
        raise ValueError(f"permute_index_triton: num_experts must be >= 1, got {e}")
    out, pp, so, rid = outputs = fused_outputs(x, ids, n, probs, side, out)
    if t == 0 or k == 0:
        return no_routes(outputs)
    ns = so.shape[1] if side is not None else 0
    ids, x, side, probs = unit_stride(ids), unit_stride(x), unit_stride(side), unit_stride(probs)
    pdl = pdl_default(x) if o.pdl is None else o.pdl
    block_t = o.block_t or FUSED_INDEX_BLOCK_T
    before, total = index_block_counts(ids, e, block_t, map_tiling(t, e).num_warps, pdl)
    bh, _, kb = scatter_tile(h, x.element_size(), False)
    z = tail_programs(n)
    has_p, has_s = probs is not None, side is not None
    launch(permute_index_kernel, (t + z, cdiv(max(h, 1), bh)),
        x, out, ids, before, total, rid, probs, pp, side, so, t, n, h, k, e, ns, z,
        x.stride(0), ids.stride(0),
        probs.stride(0) if has_p else None, side.stride(0) if has_s else None,
        HAS_P=has_p, HAS_SIDE=has_s, BLOCK_T=block_t, BLOCK_K=next_pow2(k),
        BLOCK_E=next_pow2(e), KB=kb, BLOCK_H=bh, BLOCK_S=next_pow2(max(ns, 1)), PDL=pdl,
        num_warps=o.num_warps or FUSED_INDEX_WARPS, **pdl_options(pdl),
        **assert_options(),  # assert_probs_not_nan
    )
    return out, pp, so, rid

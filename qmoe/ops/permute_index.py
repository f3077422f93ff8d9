"""``qmoe::permute_index``: the index-map permute that builds its row_id_map in the
scatter launch. The public ops take it for CUDA index maps when ``num_experts`` is given
(the per-expert counts need E); the op itself keeps the sorting path where that is faster
(``fused_index_wins``).

Glossary: T tokens, K slots per token, E experts, H hidden, N output rows, NS side-row
columns.

Without it an index map on CUDA is built by ``make_row_id_map`` with torch sorts (tens
of launches) unless it is small, then moved by the scatter kernel. ``permute_index_triton``
does what ``permute_mask_triton`` does for masks: per-block route counts, their scan, then
one kernel (``_kernels/permute_index.py``) whose token programs build their own map rows
and move their data rows. It needs E (``num_experts``): the counts are per expert. Its map
and rows equal ``make_row_id_map(ids, N, True, 1)`` then ``permute``, bit for bit (tests).
``python -m benchmarks sweep permute_mask --index`` times both. Off CUDA the op runs
``make_row_id_map`` then ``permute``.
"""

from __future__ import annotations

import torch

from qmoe._intmath import cdiv, next_pow2
from qmoe._library import define
from qmoe.ops import checks as C
from qmoe.ops.backend import assert_options, unit_stride
from qmoe.ops.permute_mask import (
    fused_outputs,
    fused_permute_backward,
    fused_permute_fake,
    fused_permute_setup,
    map_then_permute,
    no_routes,
)
from qmoe.ops.row_id_map import index_block_counts, pdl_default, pdl_options
from qmoe.ops.tuning import (
    FUSED_INDEX_BLOCK_T,
    FUSED_INDEX_WARPS,
    fused_index_wins,
    map_tiling,
    scatter_tile,
    tail_programs,
)


def permute_index_triton(
    x: torch.Tensor,
    ids: torch.Tensor,
    n: int,
    num_experts: int,
    probs: torch.Tensor | None = None,
    side: torch.Tensor | None = None,
    *,
    block_t: int = FUSED_INDEX_BLOCK_T,
    num_warps: int = FUSED_INDEX_WARPS,
    pdl: bool | None = None,
    out: torch.Tensor | None = None,
):
    """``(out [N, H], permuted_probs [N] or empty, side_out [N, NS] or empty, row_id_map
    [T, 2K+1] int32)`` of ``x [T, H]`` by the index map ``ids [T, K]`` (expert ids in
    ``[-1, num_experts)``, ``-1`` not routed; an id outside fails a device assert, and
    the public ops reject it first), with
    ``probs [T, K]`` and side rows ``[T, NS]`` moved alike (CUDA, or CPU under the
    interpreter). ``block_t`` tokens per count block (each token program also compares
    the ids of its block's earlier tokens), ``num_warps`` of the fused kernel, ``pdl`` as
    in ``permute_mask_triton`` (default ``pdl_default``), ``out`` (tests: poisoned)
    receives the rows. Three launches, no host sync."""
    from qmoe.ops._kernels.permute_index import permute_index_kernel

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
    pdl = pdl_default(x) if pdl is None else pdl
    before, total = index_block_counts(ids, e, block_t, map_tiling(t, e).num_warps, pdl)
    bh, _, kb = scatter_tile(h, x.element_size(), False)
    z = tail_programs(n)
    has_p, has_s = probs is not None, side is not None
    permute_index_kernel[(t + z, cdiv(max(h, 1), bh))](
        x, out, ids, before, total, rid, probs, pp if has_p else None, side,
        so if has_s else None, t, n, h, k, e, ns, z, x.stride(0), ids.stride(0),
        probs.stride(0) if has_p else None, side.stride(0) if has_s else None,
        HAS_P=has_p, HAS_SIDE=has_s, BLOCK_T=block_t, BLOCK_K=next_pow2(k),
        BLOCK_E=next_pow2(e), KB=kb, BLOCK_H=bh, BLOCK_S=next_pow2(max(ns, 1)), PDL=pdl,
        num_warps=num_warps, **pdl_options(pdl), **assert_options(),  # assert_probs_not_nan
    )
    return out, pp, so, rid


@define(
    "permute_index(Tensor inp, Tensor routing_map, Tensor? probs, Tensor? side, "
    "SymInt num_out_tokens, SymInt num_experts) -> (Tensor, Tensor, Tensor, Tensor)"
)
def _permute_index(inp, routing_map, probs, side, num_out_tokens, num_experts):
    """``(out [N, H], permuted_probs [N] or empty, side_out [N, NS] or empty, row_id_map
    [T, 2K+1] int32)``: ``inp [T, H]`` grouped by the index map ``[T, K]`` (ids in
    ``[-1, num_experts)``), with ``probs [T, K]`` and side rows ``[T, NS]`` (block scales
    of quantized rows) moved alike. No host sync. On CUDA the fused kernel where it wins
    (``fused_index_wins``; its device assert checks the ids), else the sorting map then one
    scatter of rows, side rows and probs (ids past ``num_experts`` unchecked there: the
    public ops check them first, and the sorting path needs no E); on CPU the same two
    steps after a check of the ids."""
    if inp.is_cuda and fused_index_wins(*routing_map.shape, num_experts):
        return permute_index_triton(inp, routing_map, num_out_tokens, num_experts, probs, side)
    if not inp.is_cuda:  # the kernel's assert, as a ValueError
        C.check_range("qmoe::permute_index", routing_map, -1, num_experts,
                      f"routing_map ids must be in [-1, num_experts={num_experts}); check "
                      "the router's output")
    return map_then_permute(inp, routing_map, probs, side, num_out_tokens, True, 1)


_permute_index.register_fake(fused_permute_fake)
_permute_index.register_autograd(fused_permute_backward, setup_context=fused_permute_setup)


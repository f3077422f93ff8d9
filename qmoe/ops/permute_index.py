"""``qmoe::permute_index``: the index-map permute that builds its row_id_map in the
scatter launch. The public ops take it for CUDA index maps when ``num_experts`` is given
(the per-expert counts need E); the op itself keeps the sorting path where that is faster
(``fused_index_wins``).

Glossary: T tokens, K slots per token, E experts, H hidden, N output rows, NS side-row
columns.

Without it an index map on CUDA is built by ``make_row_id_map`` with torch sorts (tens
of launches) unless it is small, then moved by the scatter kernel. ``permute_index_triton``
does what ``permute_mask_triton`` does for masks: per-block route counts, their scan, then
one kernel (``kernels/permute_index.py``) whose token programs build their own map rows
and move their data rows. It needs E (``num_experts``): the counts are per expert. Its map
and rows equal ``make_row_id_map(ids, N, True, 1)`` then ``permute``, bit for bit (tests).
``python -m benchmarks sweep permute_mask --index`` times both. Off CUDA the op runs
``make_row_id_map`` then ``permute``.
"""

from __future__ import annotations

from qmoe._library import define
from qmoe.ops import checks as C
from qmoe.ops.kernels.permute_index import permute_index_triton
from qmoe.ops.kernels.row_id_map import index_rows_triton
from qmoe.ops.permute_mask import (
    fused_permute_backward,
    fused_permute_fake,
    fused_permute_setup,
    map_then_permute,
)
from qmoe.ops.tuning import fused_index_wins, small_index_map


@define(
    "permute_index(Tensor inp, Tensor routing_map, Tensor? probs, Tensor? side, "
    "SymInt num_out_tokens, SymInt num_experts) -> (Tensor, Tensor?, Tensor?, Tensor)"
)
def _permute_index(inp, routing_map, probs, side, num_out_tokens, num_experts):
    """``(out [N, H], permuted_probs [N] or None, side_out [N, NS] or None, row_id_map
    [T, 2K+1] int32)`` (None without probs, without side rows): ``inp [T, H]`` grouped
    by the index map ``[T, K]`` (ids in ``[-1, num_experts)``), with ``probs [T, K]`` and
    side rows ``[T, NS]`` (block scales of quantized rows) moved alike. CPU: the ids
    checked (a host sync), then ``make_row_id_map`` and the rows moved; CUDA:
    ``_permute_index_cuda``, no host sync."""
    C.check_range("qmoe::permute_index", routing_map, -1, num_experts,
                  f"routing_map ids must be in [-1, num_experts={num_experts}); check "
                  "the router's output")  # the kernel's assert, as a ValueError
    return map_then_permute(inp, routing_map, probs, side, num_out_tokens, True, 1)


@_permute_index.register_cuda
def _permute_index_cuda(inp, routing_map, probs, side, num_out_tokens, num_experts):
    """The fused kernel where it wins; for a small map the one-launch map kernel, then one
    scatter (both kernels assert the ids are in ``[-1, num_experts)``); else the sorting
    map then one scatter (ids past ``num_experts`` unchecked there: the public ops check
    them first, and the sorting path needs no E)."""
    t, k = routing_map.shape
    if fused_index_wins(t, k, num_experts):
        return permute_index_triton(inp, routing_map, num_out_tokens, num_experts, probs, side)
    maps = index_rows_triton(routing_map, num_out_tokens, num_experts) if (
        small_index_map(t, k)) else None
    return map_then_permute(inp, routing_map, probs, side, num_out_tokens, True, 1, maps)


_permute_index.register_fake(fused_permute_fake)
_permute_index.register_autograd(fused_permute_backward, setup_context=fused_permute_setup)


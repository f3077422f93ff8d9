"""qmoe's ``row_id_map``: where each token's routed copies live in the permuted output.

Glossary: T tokens, E experts, K top-k slots, S slots per token (E for a mask map, K for
an index map), N output rows.

Format: ``int32`` ``[T, 2*S + 1]``. For token ``t``, with ``n = row_id_map[t, 2*S]``:

* ``row_id_map[t, :n]``: the output rows of its kept routes, ascending (so in expert order);
* ``row_id_map[t, S:S+n]``: for each of them, the column of ``probs`` / ``merging_probs``
  that weights it (the expert for a mask map, the slot k for an index map);
* every other entry of the first ``2*S`` columns is ``-1``.

Rows are expert-major and token-minor: ``row(t, e) = start[e] + #{t' < t routed to e}``
with ``start[e]`` the rows of all lower experts (padded to ``align_size`` when asked).
Routes whose row would be ``>= num_out_tokens`` are dropped: they are absent from the map,
so nothing ever writes past the output. T is ``row_id_map.shape[0]``.

The map is built on the input's device with a handful of linear passes (cumulative sums
over ``[T, S]`` and, for index maps, a per-token sort of the K ids and one stable sort of
the ``T*K`` expert ids; on CUDA,
Triton kernels: three launches for a mask, or one for a small mask or a small index map,
whose programs each count over the whole input: quadratic work, kept to small inputs);
there is no host sync and no workspace kept between calls.

``make_row_id_map`` also returns ``fill``: ``int32 [R, 2]``, the row ranges ``[lo, hi)``
of the output that no route writes, so the permute kernels zero exactly those rows in
their own launch (no per-row "written" flags, no second pass). ``R = E + 1`` for a padded
mask map (after each expert's rows, its padding; then the tail past the padded total) and
``R = 1`` otherwise (the tail ``[kept routes, N)``). Ranges are clipped to ``[0, N)``.
"""

from __future__ import annotations

import torch

from qmoe._library import define
from qmoe.ops.checks import ID_LIMIT
from qmoe.ops.kernels.row_id_map import index_rows_triton, mask_rows_triton
from qmoe.ops.launch import fill_count
from qmoe.ops.tuning import small_index_map


def compact_routes(dst: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """A ``row_id_map`` (module docs) from each token's routes ``dst`` (output rows, ``-1``
    where not kept) and their probs columns ``col``, both ``[T, S]``: the valid (``dst >=
    0``) entries of each row packed first, keeping their order, then the count."""
    t, s = dst.shape
    valid = dst >= 0
    slot = torch.cumsum(valid, dim=1, dtype=torch.int32) - 1
    slot = torch.where(valid, slot, s)  # invalid entries land in a scratch column
    out = torch.full((t, 2 * s + 2), -1, dtype=torch.int32, device=dst.device)
    out[:, : s + 1].scatter_(1, slot.long(), torch.where(valid, dst, -1))
    out[:, s + 1 : 2 * s + 2].scatter_(1, slot.long(), torch.where(valid, col, -1))
    rid = torch.cat(
        [out[:, :s], out[:, s + 1 : 2 * s + 1], valid.sum(1, dtype=torch.int32)[:, None]], dim=1
    )
    return rid.contiguous()


def fill_rows(counts: torch.Tensor, num_out_tokens: int, align_size: int) -> torch.Tensor:
    """``fill`` (module docs) from the routed count per expert (``[E]``, a padded mask map)
    or in total (one element: unpadded maps). Device ops, no host sync."""
    n = num_out_tokens
    c = counts.reshape(-1).to(torch.int64)
    if align_size > 1:
        padded = (c + (align_size - 1)) // align_size * align_size
        end = torch.cumsum(padded, 0)
        lo = torch.cat([end - padded + c, end[-1:] if c.numel() else c.new_zeros(1)])
        hi = torch.cat([end, c.new_full((1,), n)])
    else:
        lo, hi = c.sum().reshape(1), c.new_full((1,), n)
    return torch.stack([lo.clamp(max=n), hi.clamp(max=n)], dim=1).to(torch.int32)


def _mask_rows(routing_map: torch.Tensor, num_out_tokens: int, align_size: int) -> torch.Tensor:
    m = routing_map != 0  # (T, E)
    mi = m.to(torch.int32)
    counts = mi.sum(0, dtype=torch.int32)  # (E,)
    if align_size > 1:
        counts = (counts + (align_size - 1)) // align_size * align_size
    start = torch.cumsum(counts, 0, dtype=torch.int32) - counts  # exclusive
    rank = torch.cumsum(mi, 0, dtype=torch.int32) - 1
    dst = torch.where(m & (start + rank < num_out_tokens), start + rank, -1)
    col = torch.arange(m.shape[1], dtype=torch.int32, device=m.device).expand_as(dst)
    return compact_routes(dst, col)


def _index_rows(routing_map: torch.Tensor, num_out_tokens: int) -> torch.Tensor:
    t, k = routing_map.shape
    big = ID_LIMIT  # the "unrouted" sort key: the public ops check ids < ID_LIMIT
    # int32 sort keys (faster on CUDA)
    ids = routing_map.to(torch.int32)
    # Each token's slots by expert (stable: equal ids keep slot order), unrouted (-1) last:
    # the kept routes come out packed to the front and in row order, as the map wants.
    key, slot = torch.sort(torch.where(ids >= 0, ids, big), dim=1, stable=True)
    # One stable sort of the (t, slot)-ordered keys: expert-major, token-minor. The rank
    # of a routed entry is its output row (unrouted entries sort after every routed one).
    order = torch.sort(key.reshape(-1), stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    rank = rank.view(t, k).to(torch.int32)
    keep = (key != big) & (rank < num_out_tokens)  # dropped routes are a suffix per token
    dst = torch.where(keep, rank, -1)
    col = torch.where(keep, slot.to(torch.int32), -1)
    return torch.cat([dst, col, keep.sum(1, dtype=torch.int32)[:, None]], dim=1).contiguous()


@define(
    "make_row_id_map(Tensor routing_map, SymInt num_out_tokens, bool is_index, int align_size) "
    "-> (Tensor, Tensor)"
)
def make_row_id_map(
    routing_map: torch.Tensor, num_out_tokens: int, is_index: bool, align_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row_id_map [T, 2*S + 1] int32, fill [R, 2] int32)`` (module docs) from a mask or
    index routing map, with torch ops (CPU; the CUDA kernel is ``_make_row_id_map_cuda``).
    No host sync."""
    n = num_out_tokens
    if is_index:
        return _index_rows(routing_map, n), fill_rows((routing_map >= 0).sum(), n, 1)
    counts = (routing_map != 0).sum(0) if align_size > 1 else (routing_map != 0).sum()
    return _mask_rows(routing_map, n, align_size), fill_rows(counts, n, align_size)


@make_row_id_map.register_cuda
def _make_row_id_map_cuda(routing_map, num_out_tokens, is_index, align_size):
    """Triton: one launch for a small index map, three (or one) for a mask; larger index
    maps take the torch sorts."""
    n = num_out_tokens
    t, s = routing_map.shape
    if is_index:
        if small_index_map(t, s):
            return index_rows_triton(routing_map, n)
        return _index_rows(routing_map, n), fill_rows((routing_map >= 0).sum(), n, 1)
    fill = routing_map.new_empty((fill_count(routing_map, False, align_size), 2),
                                 dtype=torch.int32)
    return mask_rows_triton(routing_map, n, align_size, fill), fill


@make_row_id_map.register_fake
def _(routing_map, num_out_tokens, is_index, align_size):
    t, s = routing_map.shape
    r = fill_count(routing_map, is_index, align_size)
    return (routing_map.new_empty((t, 2 * s + 1), dtype=torch.int32),
            routing_map.new_empty((r, 2), dtype=torch.int32))

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

import os

import torch

from qmoe._intmath import cdiv, next_pow2
from qmoe._library import define
from qmoe.ops.checks import ID_LIMIT
from qmoe.ops.tuning import (
    MapTiling,
    map_tiling,
    scan_tile,
    small_index_map,
    small_index_tile,
    small_map_walk,
    small_mask,
)


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


def fill_count(routing_map: torch.Tensor, is_index: bool, align_size: int) -> int:
    """R, the rows of ``fill``."""
    return routing_map.shape[1] + 1 if not is_index and align_size > 1 else 1


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


def unit_stride(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` (or None) with unit stride along its last dim: the kernels step columns by 1
    and take only a row stride (a copy only for column-strided tensors, e.g. the
    transpose of a contiguous one)."""
    if t is None or t.stride(-1) == 1 or t.shape[-1] <= 1:
        return t
    return t.contiguous()


def mask_operand(routing_map: torch.Tensor) -> torch.Tensor:
    """The ``[T, E]`` mask as the Triton kernels read it: bool viewed as uint8, unit
    column stride."""
    m = routing_map.view(torch.uint8) if routing_map.dtype == torch.bool else routing_map
    return unit_stride(m)


def pdl_default(x: torch.Tensor) -> bool:
    """Whether the fused mask kernels on ``x``'s device launch as programmatic dependents
    of the scan (``block_counts(..., pdl=True)``): NVIDIA devices of compute capability 9
    (Hopper) or newer, with a Triton that has grid dependency control (``gdc_wait``, Triton
    >= 3.4) and a CUDA of at least 12.3 (programmatic edges in captured CUDA graphs); never
    on ROCm (which reports other capabilities through the same call) or under the
    interpreter."""
    if not x.is_cuda or torch.version.hip is not None or torch.version.cuda is None:
        return False
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):  # read per call
        return False
    if tuple(int(v) for v in torch.version.cuda.split(".")[:2]) < (12, 3):
        return False
    import triton.language as tl

    cuda = getattr(tl.extra, "cuda", None)
    return (hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")
            and torch.cuda.get_device_capability(x.device)[0] >= 9)


def pdl_options(pdl: bool) -> dict[str, bool]:
    """Launch options of a kernel launched as a programmatic dependent when ``pdl``: only
    then is ``launch_pdl`` passed (Tritons before 3.4 do not know the option). A new dict
    each call."""
    return {"launch_pdl": True} if pdl else {}


def block_counts(m: torch.Tensor, block_t: int, num_warps: int, pdl: bool = False):
    """``(before [cdiv(T, block_t), E], total [E])`` int32 of a mask from
    ``mask_operand`` in two launches: each block's tokens per expert, then their exclusive
    prefix over the blocks (tokens of earlier blocks) and each expert's total. ``pdl``
    (Hopper): the scan launches as a programmatic dependent of the count pass and lets the
    next launch (a fused kernel with ``launch_pdl=True``, which must ``gdc_wait`` before
    reading these) start early; the count pass itself launches in stream order."""
    from qmoe.ops._kernels.row_id_map import mask_block_counts_kernel

    t, e = m.shape
    be = next_pow2(e)
    nblk = cdiv(t, block_t)
    before = m.new_empty((nblk, e), dtype=torch.int32)
    total = m.new_empty((e,), dtype=torch.int32)
    mask_block_counts_kernel[(nblk,)](m, before, t, e, m.stride(0), BLOCK_T=block_t,
                                      BLOCK_E=be, PDL=pdl, num_warps=num_warps)
    _scan_block_counts(before, total, pdl)
    return before, total


def index_block_counts(ids: torch.Tensor, e: int, block_t: int, num_warps: int,
                       pdl: bool = False):
    """``block_counts`` of an index map ``ids [T, K]`` (ids in ``[-1, e)``, unit column
    stride): routes per expert of each block, then their scan and each expert's total."""
    from qmoe.ops._kernels.row_id_map import index_block_counts_kernel

    t, k = ids.shape
    nblk = cdiv(t, block_t)
    before = ids.new_empty((nblk, e), dtype=torch.int32)
    total = ids.new_empty((e,), dtype=torch.int32)
    index_block_counts_kernel[(nblk,)](ids, before, t, k, e, ids.stride(0), BLOCK_T=block_t,
                                       BLOCK_K=next_pow2(k), BLOCK_E=next_pow2(e), PDL=pdl,
                                       num_warps=num_warps)
    _scan_block_counts(before, total, pdl)
    return before, total


def _scan_block_counts(before: torch.Tensor, total: torch.Tensor, pdl: bool) -> None:
    """The scan launch of ``block_counts``: ``before [NBLK, E]`` in place to the counts of
    earlier blocks, ``total [E]`` the sums."""
    from qmoe.ops._kernels.row_id_map import block_scan_kernel

    nblk, e = before.shape
    cols, chunk = scan_tile(nblk, e)
    block_scan_kernel[(cdiv(e, cols),)](before, total, nblk, e, CHUNK_B=chunk, COLS=cols,
                                        PDL=pdl, **pdl_options(pdl))


def _mask_rows_triton(
    routing_map: torch.Tensor,
    num_out_tokens: int,
    align_size: int,
    tiling: MapTiling | None = None,
    one_launch: bool | None = None,
    pdl: bool = False,
):
    """``(row_id_map, fill)`` from Triton launches over the mask (CUDA, or the
    interpreter): three (counts, scan, map), or one for masks of at most
    ``SMALL_MAP_BYTES`` (``one_launch`` forces either). ``tiling`` overrides
    ``map_tiling`` (tests shrink it to reach many blocks with small inputs; the sweep
    tries others). ``pdl`` (Hopper; off by default): the scan and the map pass as
    programmatic dependent launches. ``python -m benchmarks sweep map --pdl 0,1`` on the H200
    (docs/benchmarks.md, "Mask map (`make_row_id_map`, `map_tiling`)", its paragraph on
    PDL staying off for the map pass): PDL is 0.5-1.9 us faster at dsv3, qwen3next and
    mixtral, but twice as slow at qwen3 and gptoss (0.038 against 0.022 ms, 0.034 against
    0.018; one-warp map programs). Unlike the fused kernels, the map pass has no loads to
    issue before its wait."""
    from qmoe.ops._kernels.row_id_map import mask_row_id_map_kernel, mask_row_id_map_small_kernel

    t, e = routing_map.shape
    rid = routing_map.new_empty((t, 2 * e + 1), dtype=torch.int32)
    if t == 0 or e == 0:
        counts = routing_map.new_zeros((e if align_size > 1 else 1,), dtype=torch.int32)
        return (rid.fill_(0) if e == 0 else rid), fill_rows(counts, num_out_tokens, align_size)
    fill = rid.new_empty((fill_count(routing_map, False, align_size), 2))
    m = mask_operand(routing_map)
    be = next_pow2(e)
    bt, nw, pf = tiling or map_tiling(t, e)
    if bt < 1 or pf < 1 or nw < 1 or nw & (nw - 1):
        raise ValueError(f"map tiling {tiling}: block_t and prefetch must be >= 1 and "
                         "num_warps a power of two")
    nblk = cdiv(t, bt)
    a = max(align_size, 1)
    if one_launch if one_launch is not None else small_mask(m):
        chunk, small_warps = small_map_walk(t, be, nw)
        mask_row_id_map_small_kernel[(nblk,)](
            m, rid, fill, t, e, num_out_tokens, a, m.stride(0), BLOCK_T=bt, BLOCK_E=be,
            CHUNK_T=chunk, PREFETCH=min(pf, bt), num_warps=small_warps,
        )
        return rid, fill
    counts, total = block_counts(m, bt, nw, pdl)
    mask_row_id_map_kernel[(nblk,)](
        m, counts, total, rid, fill, t, e, num_out_tokens, a, m.stride(0),
        BLOCK_T=bt, BLOCK_E=be, PREFETCH=min(pf, bt), PDL=pdl, num_warps=nw,
        **pdl_options(pdl),
    )
    return rid, fill


def _index_rows_triton(routing_map: torch.Tensor, num_out_tokens: int):
    """``(row_id_map, fill)`` of a small index map in one Triton launch (CUDA, or the
    interpreter); equal to ``_index_rows`` and its ``fill``."""
    from qmoe.ops._kernels.row_id_map import index_row_id_map_small_kernel

    t, k = routing_map.shape
    ids = unit_stride(routing_map)
    rid = ids.new_empty((t, 2 * k + 1), dtype=torch.int32)
    fill = rid.new_empty((1, 2))
    chunk, nw = small_index_tile(t, k)
    index_row_id_map_small_kernel[(t,)](
        ids, rid, fill, t, k, num_out_tokens, ids.stride(0), BLOCK_K=next_pow2(k),
        CHUNK=chunk, num_warps=nw,
    )
    return rid, fill


@define(
    "make_row_id_map(Tensor routing_map, SymInt num_out_tokens, bool is_index, int align_size) "
    "-> (Tensor, Tensor)"
)
def make_row_id_map(
    routing_map: torch.Tensor, num_out_tokens: int, is_index: bool, align_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row_id_map [T, 2*S + 1] int32, fill [R, 2] int32)`` (module docs) from a mask or
    index routing map. No host sync."""
    n = num_out_tokens
    if is_index:
        t, k = routing_map.shape
        if routing_map.is_cuda and small_index_map(t, k):
            return _index_rows_triton(routing_map, n)
        return _index_rows(routing_map, n), fill_rows((routing_map >= 0).sum(), n, 1)
    if routing_map.is_cuda:
        return _mask_rows_triton(routing_map, n, align_size)
    counts = (routing_map != 0).sum(0) if align_size > 1 else (routing_map != 0).sum()
    return _mask_rows(routing_map, n, align_size), fill_rows(counts, n, align_size)


@make_row_id_map.register_fake
def _(routing_map, num_out_tokens, is_index, align_size):
    t, s = routing_map.shape
    r = fill_count(routing_map, is_index, align_size)
    return (routing_map.new_empty((t, 2 * s + 1), dtype=torch.int32),
            routing_map.new_empty((r, 2), dtype=torch.int32))


def num_slots(row_id_map: torch.Tensor) -> int:
    return (row_id_map.shape[1] - 1) // 2

"""``qmoe::permute_mask``: the mask permute with its row_id_map built in the same pass.

Glossary: T tokens, E experts, H hidden, N output rows, NS side-row columns.

On CUDA ``moe_permute`` (and the ``_with_probs`` and pad variants) of a mask take this op:
its kernel (``_kernels/permute_mask.py``) has every token program build its own map row
and then move its data row, so the map costs no pass of its own. Launches: the per-block
counts and their scan, then the fused kernel; one launch for masks of at most
``tuning.SMALL_MAP_BYTES`` (every program counts the whole mask itself). The map and output
equal ``make_row_id_map`` then ``permute``'s, which is what the op runs off CUDA.
"""

from __future__ import annotations

import torch

from qmoe._intmath import cdiv, next_pow2
from qmoe._library import define
from qmoe.ops.backend import assert_options, unit_stride
from qmoe.ops.row_id_map import block_counts, mask_operand, pdl_default, pdl_options
from qmoe.ops.tuning import (
    FUSED_TOKENS,
    FUSED_WARPS,
    MapTiling,
    count_chunk,
    fused_map_tiling,
    reg_routes_flag,
    scatter_tile,
    small_mask,
    tail_programs,
)

ops = torch.ops.qmoe


def permute_mask_triton(
    x: torch.Tensor,
    mask: torch.Tensor,
    n: int,
    align_size: int,
    probs: torch.Tensor | None = None,
    side: torch.Tensor | None = None,
    *,
    one_launch: bool | None = None,
    tiling: MapTiling | None = None,
    num_warps: int | None = None,
    tokens: int | None = None,
    reg_routes: bool | None = None,
    block_h: int | None = None,
    pdl: bool | None = None,
    out: torch.Tensor | None = None,
):
    """``(out [N, H], permuted_probs [N] or empty, side_out [N, NS] or empty, row_id_map
    [T, 2E+1] int32)`` of ``x [T, H]`` by ``mask [T, E]`` (CUDA, or CPU under the
    interpreter), as ``make_row_id_map`` then ``permute_rows``. ``one_launch`` forces the
    SMALL form on or off; ``tiling`` overrides ``fused_map_tiling`` (its block and warps
    set the count pass), ``num_warps`` the fused kernel's ``FUSED_WARPS``, ``tokens`` its
    tokens per program (default 1; must divide the count block), ``block_h`` its
    columns a program (default ``scatter_tile``'s; benchmarks); ``pdl`` whether the
    scan and the fused kernel launch as programmatic dependents (default ``pdl_default``:
    Hopper or newer; never in the one-launch form); ``out`` (tests: poisoned) receives
    the rows. No host sync."""
    from qmoe.ops._kernels.permute_mask import permute_mask_kernel

    t, h = x.shape
    e = mask.shape[1]
    out, pp, so, rid = outputs = fused_outputs(x, mask, n, probs, side, out)
    if t == 0 or e == 0:
        return no_routes(outputs)
    ns = so.shape[1] if side is not None else 0
    m = mask_operand(mask)
    x, probs, side = unit_stride(x), unit_stride(probs), unit_stride(side)
    be = next_pow2(e)
    bt, map_warps, _ = tiling or fused_map_tiling(t, e)
    bh, _, kb = scatter_tile(h, x.element_size(), False)
    bh = block_h or bh
    nw = num_warps or FUSED_WARPS
    small = one_launch if one_launch is not None else small_mask(m)
    pdl = not small and (pdl_default(x) if pdl is None else pdl)
    before, total = (None, None) if small else block_counts(m, bt, map_warps, pdl)
    ranges = e if align_size > 1 else 0
    z = tail_programs(n)
    has_p, has_s = probs is not None, side is not None
    tokens = tokens or FUSED_TOKENS
    if not small and bt % tokens:
        raise ValueError(f"tokens per program ({tokens}) must divide the count block ({bt})")
    permute_mask_kernel[(cdiv(t, tokens) + ranges + z, cdiv(max(h, 1), bh))](
        x, out, m, before, total, rid, probs, pp if has_p else None, side,
        so if has_s else None, t, n, h, e, ns, max(align_size, 1), z, x.stride(0),
        m.stride(0), probs.stride(0) if has_p else None, side.stride(0) if has_s else None,
        HAS_P=has_p, HAS_SIDE=has_s, SMALL=small, BLOCK_T=bt, BLOCK_E=be,
        CHUNK_T=count_chunk(t, be, nw), KB=kb, BLOCK_H=bh,
        BLOCK_S=next_pow2(max(ns, 1)), TOKENS=tokens,
        REG_ROUTES=reg_routes_flag(be, reg_routes), PDL=pdl, num_warps=nw,
        **pdl_options(pdl), **assert_options(),  # assert_probs_not_nan
    )
    return out, pp, so, rid


def fused_outputs(x, routing_map, n, probs, side, out=None):
    """``(out [N, H] (the given ``out``, else new), permuted probs [N] or empty, side rows
    [N, NS] or empty, row_id_map [T, 2S+1] int32)``, unwritten, for a fused permute
    launcher of ``x [T, H]`` by ``routing_map [T, S]``."""
    t, s = routing_map.shape
    rid = routing_map.new_empty((t, 2 * s + 1), dtype=torch.int32)
    out = x.new_empty((n, x.shape[1])) if out is None else out
    pp = probs.new_empty((n,)) if probs is not None else x.new_empty(0)
    so = side.new_empty((n, side.shape[1])) if side is not None else x.new_empty(0)
    return out, pp, so, rid


def no_routes(outputs):
    """``fused_outputs`` filled for a call without routes (no tokens or no slots): every
    row zero, every map row empty."""
    out, pp, so, rid = outputs
    for buf in (out, pp, so):
        buf.zero_()
    rid.fill_(-1)[:, -1] = 0
    return outputs


@define(
    "permute_mask(Tensor inp, Tensor routing_map, Tensor? probs, Tensor? side, "
    "SymInt num_out_tokens, int align_size) -> (Tensor, Tensor, Tensor, Tensor)"
)
def _permute_mask(inp, routing_map, probs, side, num_out_tokens, align_size):
    """``(out [N, H], permuted_probs [N] or empty, side_out [N, NS] or empty, row_id_map
    [T, 2E+1] int32)``: ``inp [T, H]`` grouped by the ``[T, E]`` mask, each expert's group
    padded to ``align_size``, with ``probs [T, E]`` and side rows ``[T, NS]`` (block scales
    of quantized rows) moved alike. No host sync."""
    if inp.is_cuda:
        return permute_mask_triton(inp, routing_map, num_out_tokens, align_size, probs, side)
    return map_then_permute(inp, routing_map, probs, side, num_out_tokens, False, align_size)


def map_then_permute(inp, routing_map, probs, side, n, is_index, align_size):
    """What a fused permute op runs where it takes no fused kernel (``permute_mask`` off
    CUDA, ``permute_index`` off CUDA or where the fused kernel loses): ``make_row_id_map``
    then the rows, probs and side rows moved (``permute_with_scales``: one scatter on
    CUDA); same outputs."""
    rid, fill = ops.make_row_id_map(routing_map, n, is_index, align_size)
    if side is None:
        out, pp = ops.permute(inp, rid, probs, n, fill)
        return out, pp, inp.new_empty(0), rid
    out, so, pp = ops.permute_with_scales(inp, side, rid, probs, n, fill)
    return out, pp, so, rid


def fused_permute_fake(inp, routing_map, probs, side, num_out_tokens, *_):
    """Fake outputs of a fused permute op: rows ``[N, H]``, probs ``[N]`` or empty, side
    rows ``[N, NS]`` or empty, the map ``[T, 2S+1]`` int32 (S: routing_map's columns)."""
    n = num_out_tokens
    t, s = routing_map.shape
    return (inp.new_empty((n, inp.shape[1])),
            probs.new_empty((n,)) if probs is not None else inp.new_empty(0),
            side.new_empty((n, side.shape[1])) if side is not None else inp.new_empty(0),
            routing_map.new_empty((t, 2 * s + 1), dtype=torch.int32))


_permute_mask.register_fake(fused_permute_fake)


def fused_permute_setup(ctx, inputs, output):
    """Autograd setup of the fused permutes (``permute_mask``, ``permute_index``): the map
    (output 3) and the probs' shape and dtype."""
    probs = inputs[2]
    ctx.save_for_backward(output[3])
    ctx.probs_meta = None if probs is None else (tuple(probs.shape), probs.dtype)


def fused_permute_backward(ctx, grad_out, grad_pp, grad_side, grad_rid):
    """The fused permutes' backward: the rows' gradient merged back (``permute_grads``),
    the probs' from the permuted probs'; none for the routing map, side rows or sizes."""
    from qmoe.ops.permute import permute_grads

    (rid,) = ctx.saved_tensors
    grad_inp, gp = permute_grads(rid, grad_out, grad_pp, ctx.probs_meta)
    return grad_inp, None, gp, None, None, None


_permute_mask.register_autograd(fused_permute_backward, setup_context=fused_permute_setup)

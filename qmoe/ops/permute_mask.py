"""``qmoe::permute_mask``: the mask permute with its row_id_map built in the same pass.

Glossary: T tokens, E experts, H hidden, N output rows, NS side-row columns.

On CUDA ``moe_permute`` (and the ``_with_probs`` and pad variants) of a mask take this op:
its kernel (``kernels/permute_mask.py``) has every token program build its own map row
and then move its data row, so the map costs no pass of its own. Launches: the per-block
counts and their scan, then the fused kernel; one launch for masks of at most
``tuning.SMALL_MAP_BYTES`` (every program counts the whole mask itself). The map and output
equal ``make_row_id_map`` then ``permute``'s, which is what the op runs off CUDA.
"""

from __future__ import annotations

import torch

from qmoe._library import define, direct
from qmoe.ops.kernels.permute_mask import permute_mask_triton
from qmoe.ops.row_id_map import make_row_id_map
from qmoe.ops.unpermute import permute_grads

ops = torch.ops.qmoe


@define(
    "permute_mask(Tensor inp, Tensor routing_map, Tensor? probs, Tensor? side, "
    "SymInt num_out_tokens, int align_size) -> (Tensor, Tensor?, Tensor?, Tensor)"
)
def _permute_mask(inp, routing_map, probs, side, num_out_tokens, align_size):
    """``(out [N, H], permuted_probs [N] or None, side_out [N, NS] or None, row_id_map
    [T, 2E+1] int32)`` (None without probs, without side rows): ``inp [T, H]`` grouped
    by the ``[T, E]`` mask, each expert's group padded to ``align_size``, with ``probs
    [T, E]`` and side rows ``[T, NS]`` (block scales of quantized rows) moved alike:
    ``make_row_id_map`` then the rows moved (CPU; the fused kernel on CUDA). No host
    sync."""
    return map_then_permute(inp, routing_map, probs, side, num_out_tokens, False, align_size)


@_permute_mask.register_cuda
def _permute_mask_cuda(inp, routing_map, probs, side, num_out_tokens, align_size):
    """The fused kernel: the map built in the scatter launch. No host sync."""
    return permute_mask_triton(inp, routing_map, num_out_tokens, align_size, probs, side)


def map_then_permute(inp, routing_map, probs, side, n, is_index, align_size, maps=None):
    """What a fused permute op runs where it takes no fused kernel (``permute_mask`` off
    CUDA, ``permute_index`` off CUDA or where the fused kernel loses): ``make_row_id_map``
    (or the given ``maps``, its ``(row_id_map, fill)``) then the rows, probs and side rows
    moved (``permute_with_scales``: one scatter on CUDA); same outputs."""
    rid, fill = maps if maps is not None else make_row_id_map(routing_map, n, is_index,
                                                              align_size)
    if side is None:  # (the ops are defined above this module: their Op through direct)
        out, pp = direct(ops.permute.default)(inp, rid, probs, n, fill)
        return out, pp if probs is not None else None, None, rid
    out, so, pp = direct(ops.permute_with_scales.default)(inp, side, rid, probs, n, fill)
    return out, pp if probs is not None else None, so, rid


def fused_permute_fake(inp, routing_map, probs, side, num_out_tokens, *_):
    """Fake outputs of a fused permute op: rows ``[N, H]``, probs ``[N]`` or None, side
    rows ``[N, NS]`` or None, the map ``[T, 2S+1]`` int32 (S: routing_map's columns)."""
    n = num_out_tokens
    t, s = routing_map.shape
    return (inp.new_empty((n, inp.shape[1])),
            probs.new_empty((n,)) if probs is not None else None,
            side.new_empty((n, side.shape[1])) if side is not None else None,
            routing_map.new_empty((t, 2 * s + 1), dtype=torch.int32))


_permute_mask.register_fake(fused_permute_fake)


def fused_permute_setup(ctx, inputs, output):
    """Autograd setup of the fused permutes (``permute_mask``, ``permute_index``): the map
    (output 3) and the probs' shape and dtype."""
    probs = inputs[2]
    ctx.set_materialize_grads(False)  # (permute_grads takes None for an unused output)
    ctx.save_for_backward(output[3])
    ctx.probs_meta = None if probs is None else (tuple(probs.shape), probs.dtype)


def fused_permute_backward(ctx, grad_out, grad_pp, grad_side, grad_rid):
    """The fused permutes' backward: the rows' gradient merged back (``permute_grads``),
    the probs' from the permuted probs'; none for the routing map, side rows or sizes."""
    (rid,) = ctx.saved_tensors
    grad_inp, gp = permute_grads(rid, grad_out, grad_pp, ctx.probs_meta)
    return grad_inp, None, gp, None, None, None


_permute_mask.register_autograd(fused_permute_backward, setup_context=fused_permute_setup)

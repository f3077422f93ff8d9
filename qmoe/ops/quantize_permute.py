"""Fused quantize-and-permute (``qmoe::quantize_permute``): FP8 MoE dispatch in one pass.

Glossary: T tokens, H hidden, S map slots per token, N output rows, NB scale blocks.

``moe_permute(x, routing_map, ..., quantize=recipe)`` (and the ``_with_probs`` and pad
variants) read each high-precision token row once, compute its block scales (or use the
per-tensor scale) and write the K quantized copies and their scale rows straight into the
permuted layout. The result is, bit for bit, ``moe_permute(qmoe.quantize(x, recipe), ...)``:
the kernel quantizes with the same code as ``quantize`` (``quantize_tile``). Off CUDA the
op runs those two steps. Backward: the gradient reaches ``x`` in high precision (the merge
of the output's gradient, as for ``quantize`` then ``moe_permute``).
"""

from __future__ import annotations

import torch

from qmoe._intmath import cdiv
from qmoe._library import NO_GRAD, define, eager_route
from qmoe.ops import checks as C
from qmoe.ops.kernels.quantize_permute import (
    quantize_permute_mask_triton,
    quantize_permute_triton,
)
from qmoe.ops.row_id_map import make_row_id_map
from qmoe.ops.tuning import MASK_MAP_MIN_ROWS_PER_TOKEN
from qmoe.ops.unpermute import permute_grads, probs_grad
from qmoe.tensors.base import QuantizedTensor, plain_grad
from qmoe.tensors.quantize import (
    check_given_scale,
    per_tensor_scale,
    recipe_scale_mode,
    scale_dtype,
    wrap_quantized,
)
from qmoe.tensors.recipes import MXFP8, Blockwise, PerTensor, Recipe, RowWise, block_size_of

ops = torch.ops.qmoe


def _two_step(x, rid, probs, n, block_size, fp8_dtype, scale_mode, scale):
    """``quantize`` then ``permute`` on the raw tensors (the definition; CPU path)."""
    if scale_mode == "given":
        q, s = ops.quantize_with_scale(x, scale, fp8_dtype), scale
    else:
        q, s = ops.quantize_blocks(x, block_size, fp8_dtype, scale_mode)
    bits, pp = ops.permute(q.view(torch.uint8), rid, probs, n)
    # a given scale comes back fp32 [] whatever one-element shape it came in (as the fake
    # and the kernel path)
    s_out = (s.float().reshape(()).clone() if scale_mode == "given"
             else ops.permute(s, rid, None, n)[0])
    return bits.view(fp8_dtype), s_out, pp if probs is not None else x.new_empty(0)


@define(
    "quantize_permute(Tensor x, Tensor row_id_map, Tensor? probs, SymInt num_out_tokens, "
    "int block_size, ScalarType fp8_dtype, str scale_mode, Tensor? scale, Tensor? fill=None) "
    "-> (Tensor, Tensor, Tensor)"
)
def _quantize_permute(x, row_id_map, probs, num_out_tokens, block_size, fp8_dtype,
                      scale_mode, scale, fill=None):
    """``(qdata [N, H] fp8, scale [N, NB] fp32 / uint8 e8m0 bits, or [] given,
    permuted_probs [N] or empty)``. ``fill``: the map's unwritten row ranges, or None.
    Autograd: ``permuted_probs`` to ``probs``; the fp8 bits and scales are not
    differentiable (``moe_permute(..., quantize=)`` passes the gradient to ``x`` straight
    through, in high precision). No host sync."""
    C.check_quantize_args("quantize_permute", x, block_size, fp8_dtype, scale_mode, scale)
    return _two_step(x, row_id_map, probs, num_out_tokens, block_size, fp8_dtype, scale_mode,
                     scale)


@_quantize_permute.register_cuda
def _quantize_permute_cuda(x, row_id_map, probs, num_out_tokens, block_size, fp8_dtype,
                           scale_mode, scale, fill=None):
    C.check_quantize_args("quantize_permute", x, block_size, fp8_dtype, scale_mode, scale)
    return quantize_permute_triton(x, row_id_map, probs, num_out_tokens, block_size,
                                   fp8_dtype, scale_mode, scale, fill)


@_quantize_permute.register_fake
def _(x, row_id_map, probs, num_out_tokens, block_size, fp8_dtype, scale_mode, scale,
      fill=None):
    C.check_quantize_args("quantize_permute", x, block_size, fp8_dtype, scale_mode, scale)
    n, h = num_out_tokens, x.shape[1]
    q = x.new_empty((n, h), dtype=fp8_dtype)
    if scale_mode == "given":
        s = x.new_empty((), dtype=torch.float32)
    else:
        s = x.new_empty((n, cdiv(h, block_size)), dtype=scale_dtype(scale_mode))
    pp = probs.new_empty((n,)) if probs is not None else x.new_empty(0)
    return q, s, pp


@define(
    "quantize_permute_mask(Tensor x, Tensor routing_map, Tensor? probs, SymInt num_out_tokens, "
    "int align_size, int block_size, ScalarType fp8_dtype, str scale_mode, Tensor? scale) "
    "-> (Tensor, Tensor, Tensor, Tensor)"
)
def _quantize_permute_mask(x, routing_map, probs, num_out_tokens, align_size, block_size,
                           fp8_dtype, scale_mode, scale):
    """``quantize_permute``'s outputs and the ``row_id_map`` ``[T, 2E+1]`` int32 of the
    ``[T, E]`` mask, each expert's group padded to ``align_size``. On CUDA the map is built
    inside the fused launch (after the per-block count and scan launches, or alone for a
    small mask); elsewhere ``make_row_id_map`` then ``quantize_permute``. Autograd as
    ``quantize_permute``'s. No host sync."""
    C.check_quantize_args("quantize_permute_mask", x, block_size, fp8_dtype, scale_mode, scale)
    rid, fill = make_row_id_map(routing_map, num_out_tokens, False, align_size)
    return (*ops.quantize_permute(x, rid, probs, num_out_tokens, block_size, fp8_dtype,
                                  scale_mode, scale, fill), rid)


@_quantize_permute_mask.register_cuda
def _quantize_permute_mask_cuda(x, routing_map, probs, num_out_tokens, align_size, block_size,
                                fp8_dtype, scale_mode, scale):
    """The map built in the fused launch."""
    C.check_quantize_args("quantize_permute_mask", x, block_size, fp8_dtype, scale_mode, scale)
    return quantize_permute_mask_triton(x, routing_map, num_out_tokens, align_size, probs,
                                        block_size, fp8_dtype, scale_mode, scale)


@_quantize_permute_mask.register_fake
def _(x, routing_map, probs, num_out_tokens, align_size, block_size, fp8_dtype, scale_mode,
      scale):
    C.check_quantize_args("quantize_permute_mask", x, block_size, fp8_dtype, scale_mode, scale)
    t, e = routing_map.shape
    rid = routing_map.new_empty((t, 2 * e + 1), dtype=torch.int32)
    return (*ops.quantize_permute(x, rid, probs, num_out_tokens, block_size, fp8_dtype,
                                  scale_mode, scale), rid)


def _fused_setup(ctx, inputs, output):
    """Both fused ops: ``probs`` is input 2; the map is input 1 (``quantize_permute``) or
    output 3 (``quantize_permute_mask``), and it, the bits and the scales take no grad."""
    probs = inputs[2]
    rid = output[3] if len(output) == 4 else inputs[1]
    ctx.mark_non_differentiable(*output[:2], *output[3:])
    ctx.save_for_backward(rid)
    ctx.probs_meta = None if probs is None else (tuple(probs.shape), probs.dtype)


def _fused_backward(ctx, grad_q, grad_scale, grad_probs, *grad_map):
    (rid,) = ctx.saved_tensors
    gp = None
    if ctx.probs_meta is not None and grad_probs is not None:
        (t, p), dtype = ctx.probs_meta
        gp = probs_grad(rid, grad_probs, t, p, dtype)
    return None, None, gp, None, None, None, None, None, None  # 9 inputs each


_quantize_permute.register_autograd(_fused_backward, setup_context=_fused_setup)
_quantize_permute_mask.register_autograd(_fused_backward, setup_context=_fused_setup)


def _map_in_launch(x, is_index: bool, n: int) -> bool:
    """Whether ``quantize_permute_mask`` (CUDA, mask map, N >= MASK_MAP_MIN_ROWS_PER_TOKEN
    * T) serves the call."""
    return (not is_index and x.is_cuda
            and n >= MASK_MAP_MIN_ROWS_PER_TOKEN * max(x.shape[0], 1))


def _recipe_args(x, recipe: Recipe, scale):
    """``(block_size, fp8_dtype, scale_mode, scale)`` of the fused ops for ``recipe``."""
    if isinstance(recipe, PerTensor):
        s = per_tensor_scale(x, recipe) if scale is None else scale.float().reshape(())
        return 0, recipe.fp8_dtype, "given", s
    return block_size_of(recipe, x.shape[-1]), recipe.fp8_dtype, recipe_scale_mode(recipe), None


def _fused_outputs(x, probs, routing_map, is_index, align_size, n, recipe, scale):
    """The fused path's outputs ``(quantized rows [N, H], permuted_probs, row_id_map)``,
    no autograd (``_QuantizePermute``'s forward, and eager calls that need no gradient).
    The ops are called through their ``Op`` (eager: no dispatcher)."""
    bs, fp8, mode, s = _recipe_args(x, recipe, scale)
    args = (n, bs, fp8, mode, s)
    if _map_in_launch(x, is_index, n):
        q, s_out, pp, rid = _quantize_permute_mask(x, routing_map, probs, n,
                                                   align_size, *args[1:])
    else:
        rid, fill = make_row_id_map(routing_map, n, is_index, align_size)
        q, s_out, pp = _quantize_permute(x, rid, probs, *args, fill)
    return wrap_quantized(recipe, q, s_out, x.dtype, bs), pp, rid


class _QuantizePermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, probs, routing_map, is_index, align_size, n, recipe, scale):
        out, pp, rid = _fused_outputs(x, probs, routing_map, is_index, align_size, n,
                                      recipe, scale)
        ctx.save_for_backward(rid)
        ctx.mark_non_differentiable(rid)
        ctx.probs_meta = None if probs is None else (tuple(probs.shape), probs.dtype)
        return out, pp, rid

    @staticmethod
    def backward(ctx, grad_out, grad_pp, grad_rid):
        (rid,) = ctx.saved_tensors
        gx, gp = permute_grads(rid, plain_grad(grad_out), grad_pp, ctx.probs_meta)
        return gx, gp, None, None, None, None, None, None


class _QuantizePermuteByMap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, row_id_map, n, recipe):
        bs, fp8, mode, s = _recipe_args(x, recipe, None)
        q, s_out, _ = _quantize_permute(x, row_id_map, None, n, bs, fp8, mode, s)
        ctx.save_for_backward(row_id_map)
        return wrap_quantized(recipe, q, s_out, x.dtype, bs)

    @staticmethod
    def backward(ctx, grad_out):
        (rid,) = ctx.saved_tensors
        gx, _ = permute_grads(rid, plain_grad(grad_out), None, None)
        return gx, None, None, None


def quantize_permute_by_map(x: torch.Tensor, row_id_map: torch.Tensor, n, recipe: Recipe):
    """``x [T, H]`` (high precision) quantized with ``recipe`` and moved by a given
    ``row_id_map`` (``[T, 2*S + 1]`` int32, as ``make_row_id_map`` builds it) into ``n`` rows
    in one pass: bit for bit ``qmoe::permute`` of ``qmoe.quantize(x, recipe)``. Rows no route
    names are zero. Differentiable in ``x`` (the gradient merged back, high precision).
    For callers that build their own map (``qmoe.distributed``'s capacity form). No host
    sync."""
    return _QuantizePermuteByMap.apply(x, row_id_map, n, recipe)


def quantize_and_permute(fn: str, x, probs, routing_map, is_index: bool, align_size: int, n,
                         recipe: Recipe, scale):
    """The public functions' fused path: ``(quantized output [N, H], permuted_probs,
    row_id_map)``."""
    if isinstance(x, QuantizedTensor) or type(x).__module__.startswith("torchao"):
        raise TypeError(f"{fn}: inp is already quantized ({type(x).__name__}); pass it "
                        "without quantize=, or pass the high-precision tokens")
    if not isinstance(recipe, (PerTensor, Blockwise, RowWise, MXFP8)):
        raise TypeError(f"{fn}: quantize must be qmoe.PerTensor(), qmoe.Blockwise(), "
                        f"qmoe.RowWise() or qmoe.MXFP8(), got {recipe!r}")
    if isinstance(recipe, RowWise):
        block_size_of(recipe, x.shape[-1])  # (a row too wide raises here, by name)
    if scale is not None:
        if not isinstance(recipe, PerTensor):
            raise ValueError(f"{fn}: quantize_scale is only accepted with the PerTensor recipe")
        check_given_scale(fn, "quantize_scale", scale, "inp", x)
    args = (x, probs, routing_map, is_index, align_size, n, recipe, scale)
    if eager_route((x, probs)) == NO_GRAD:  # no gradient to attach: skip the Function
        return _fused_outputs(*args)
    return _QuantizePermute.apply(*args)

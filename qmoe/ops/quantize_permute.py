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

from qmoe._intmath import cdiv, next_pow2
from qmoe._library import define
from qmoe.ops import checks as C
from qmoe.ops.backend import assert_options, unit_stride
from qmoe.ops.row_id_map import num_slots
from qmoe.ops.tuning import (
    MASK_MAP_MIN_ROWS_PER_TOKEN,
    MASK_QUANT_STEPS,
    MASK_QUANT_TILE,
    QUANT_PERMUTE_KB,
    QUANT_PERMUTE_WARPS,
    count_chunk,
    fused_map_tiling,
    quantize_permute_columns,
    reg_routes_flag,
    small_mask,
    tail_programs,
)
from qmoe.tensors.layouts import SCALE_GIVEN, SCALE_MODES, emax_elem, fp8_fields
from qmoe.tensors.quantize import (
    EPS,
    check_given_scale,
    per_tensor_scale,
    plain_grad,
    recipe_scale_mode,
    scale_dtype,
)
from qmoe.tensors.recipes import MXFP8, Blockwise, PerTensor, Recipe, fp8_max
from qmoe.tensors.tuning import PER_TENSOR_BLOCK
from qmoe.tensors.types import Float8BlockwiseTensor, Float8Tensor, MXFP8Tensor

ops = torch.ops.qmoe


def _nb(h: int, block_size: int) -> int:
    return -(-h // block_size)


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


def _outputs(x, n, block_size, fp8_dtype, scale_mode, scale, probs, poison):
    """``(q [N, H] uint8, scale out, pp [N] or empty, BS, NB)`` of the fused kernels,
    allocated (``poison``: filled with 0xFF bytes first, so a row a kernel misses shows)."""
    given = scale_mode == "given"
    bs = PER_TENSOR_BLOCK if given else block_size  # per-tensor: the block is the tile width
    nb = _nb(x.shape[1], bs)
    q = torch.empty((n, x.shape[1]), dtype=torch.uint8, device=x.device)
    if given:
        s_out = scale.float().reshape(()).clone()
    else:
        s_out = torch.empty((n, nb), dtype=scale_dtype(scale_mode), device=x.device)
    pp = probs.new_empty((n,)) if probs is not None else x.new_empty(0)
    if poison:
        for buf in (q, pp) if given else (q, s_out, pp):
            buf.view(torch.uint8).fill_(0xFF)
    return q, s_out, pp, bs, nb


def _consts(x, fp8_dtype, scale_mode, bs, nb, tile, steps) -> dict:
    """The quantizing constexprs of the fused kernels, and the column tiling: ``tile`` row
    elements a step, ``steps`` steps a program (0: the whole row, so a token's map row is
    read or built once); a tile or steps not given (None) is
    ``tuning.quantize_permute_columns``'s."""
    tile, steps = quantize_permute_columns(x.shape[1], tile, steps)
    groups = max(1, min(tile // bs, next_pow2(nb)))
    mb, bias = fp8_fields(fp8_dtype)
    return dict(FP8_MAX=fp8_max(fp8_dtype), EMAX_ELEM=emax_elem(fp8_dtype), EPS=EPS,
                SCALE_MODE=SCALE_GIVEN if scale_mode == "given" else SCALE_MODES[scale_mode],
                MB=mb, BIAS=bias, HW_CAST=x.is_cuda, BS=bs,
                GROUPS=groups, STEPS=steps or cdiv(nb, groups))


def _column_programs(nb: int, consts: dict) -> int:
    """The grid's column programs a row: ``GROUPS * STEPS`` scale blocks each."""
    return cdiv(nb, consts["GROUPS"] * consts["STEPS"])


def quantize_permute_triton(x, rid, probs, n, block_size, fp8_dtype, scale_mode, scale,
                            fill=None, *, tile=None, steps=None, kb=QUANT_PERMUTE_KB,
                            num_warps=QUANT_PERMUTE_WARPS, poison=False):
    """The fused kernel (CUDA, or CPU under TRITON_INTERPRET=1); outputs as the op's.
    ``fill``: as ``permute_rows``'s (zero the unwritten rows in the same launch).
    ``tile`` (row elements a step), ``steps`` (steps a program, 0: the whole row; None:
    the whole row at H < 4096, else one step: ``tuning.quantize_permute_columns``), ``kb``
    and ``num_warps`` set the kernel's tiling (``QUANT_PERMUTE_KB``,
    ``QUANT_PERMUTE_WARPS``). ``poison`` (tests) fills the outputs with 0xFF bytes first,
    so a row the kernel misses shows."""
    from qmoe.ops._kernels.quantize_permute import quantize_permute_kernel
    from qmoe.ops.backend import permute_rows, scatter_programs, zero_unwritten_rows

    t, h = x.shape
    q, s_out, pp, bs, nb = _outputs(x, n, block_size, fp8_dtype, scale_mode, scale, probs,
                                    poison)
    if n == 0:
        return q.view(fp8_dtype), s_out, pp
    if h == 0:  # no columns: empty bits and scale rows, nothing to quantize; probs move
        if probs is not None:
            permute_rows(x, rid, n, probs=probs, probs_out=pp, fill=fill, use_triton=True)
        return q.view(fp8_dtype), s_out, pp
    x, probs, rid = unit_stride(x), unit_stride(probs), rid.contiguous()
    fill = fill.contiguous() if fill is not None else None
    given, has_p, has_f = scale_mode == "given", probs is not None, fill is not None
    written = fill if has_f else torch.zeros(n, dtype=torch.int8, device=x.device)
    consts = _consts(x, fp8_dtype, scale_mode, bs, nb, tile, steps)
    progs, r, z = scatter_programs(t, n, fill)
    if progs:
        quantize_permute_kernel[(progs, _column_programs(nb, consts))](
            x, q, s_out, rid, probs if has_p else x, pp if has_p else written, written,
            fill if has_f else written, t, n, h, nb, num_slots(rid), r, z, x.stride(0),
            probs.stride(0) if has_p else 0, HAS_P=has_p, HAS_FILL=has_f, KB=kb,
            num_warps=num_warps, **assert_options(), **consts,  # assert_probs_not_nan
        )
    if not has_f:
        zero_unwritten_rows(q, written, pp if has_p else None, None if given else s_out)
    return q.view(fp8_dtype), s_out, pp


def quantize_permute_mask_triton(x, mask, n, align_size, probs, block_size, fp8_dtype,
                                 scale_mode, scale, *, one_launch=None, tiling=None, tile=None,
                                 steps=MASK_QUANT_STEPS, kb=QUANT_PERMUTE_KB,
                                 num_warps=QUANT_PERMUTE_WARPS, reg_routes=None, pdl=None,
                                 poison=False):
    """``(q, scale, permuted_probs, row_id_map)`` of ``x [T, H]`` by ``mask [T, E]`` with
    the map built in the fused launch (CUDA, or CPU under TRITON_INTERPRET=1): as
    ``make_row_id_map`` then ``quantize_permute_triton``, bit for bit. ``one_launch``,
    ``tiling`` and ``pdl`` as in ``permute_mask_triton``; ``tile`` (row elements a step)
    defaults to ``MASK_QUANT_TILE`` at every H, ``steps`` to ``MASK_QUANT_STEPS`` (0: the
    whole row); the rest as in ``quantize_permute_triton``. No host sync."""
    from qmoe.ops._kernels.quantize_permute import quantize_permute_mask_kernel
    from qmoe.ops.row_id_map import block_counts, mask_operand, pdl_default, pdl_options

    t, h = x.shape
    e = mask.shape[1]
    if h == 0 or t == 0 or e == 0:  # nothing to quantize, or no routes: the two ops
        rid, fill = ops.make_row_id_map(mask, n, False, align_size)
        return (*quantize_permute_triton(x, rid, probs, n, block_size, fp8_dtype, scale_mode,
                                         scale, fill, poison=poison), rid)
    q, s_out, pp, bs, nb = _outputs(x, n, block_size, fp8_dtype, scale_mode, scale, probs,
                                    poison)
    rid = mask.new_empty((t, 2 * e + 1), dtype=torch.int32)
    m = mask_operand(mask)
    x, probs = unit_stride(x), unit_stride(probs)
    bt, map_warps, _ = tiling or fused_map_tiling(t, e)
    small = one_launch if one_launch is not None else small_mask(m)
    pdl = not small and (pdl_default(x) if pdl is None else pdl)
    before, total = (None, None) if small else block_counts(m, bt, map_warps, pdl)
    ranges = e if align_size > 1 else 0
    z = tail_programs(n)
    has_p = probs is not None
    be = next_pow2(e)
    # MASK_QUANT_TILE row elements a step at every H (a token's map work is done once per
    # program, so splitting a row over programs repeats it; 1024 lost 8-16 points)
    consts = _consts(x, fp8_dtype, scale_mode, bs, nb, tile or MASK_QUANT_TILE, steps)
    quantize_permute_mask_kernel[(t + ranges + z, _column_programs(nb, consts))](
        x, q, s_out, m, before, total, rid, probs, pp if has_p else None, t, n, h, nb, e,
        max(align_size, 1), z, x.stride(0), m.stride(0), probs.stride(0) if has_p else None,
        HAS_P=has_p, SMALL=small, BLOCK_T=bt, BLOCK_E=be,
        CHUNK_T=count_chunk(t, be, num_warps), KB=kb,
        REG_ROUTES=reg_routes_flag(be, reg_routes), PDL=pdl, num_warps=num_warps,
        **pdl_options(pdl), **assert_options(), **consts,  # assert_probs_not_nan
    )
    return q.view(fp8_dtype), s_out, pp, rid


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
    if x.is_cuda:
        return quantize_permute_triton(x, row_id_map, probs, num_out_tokens, block_size,
                                       fp8_dtype, scale_mode, scale, fill)
    return _two_step(x, row_id_map, probs, num_out_tokens, block_size, fp8_dtype, scale_mode,
                     scale)


@_quantize_permute.register_fake
def _(x, row_id_map, probs, num_out_tokens, block_size, fp8_dtype, scale_mode, scale,
      fill=None):
    C.check_quantize_args("quantize_permute", x, block_size, fp8_dtype, scale_mode, scale)
    n, h = num_out_tokens, x.shape[1]
    q = x.new_empty((n, h), dtype=fp8_dtype)
    if scale_mode == "given":
        s = x.new_empty((), dtype=torch.float32)
    else:
        s = x.new_empty((n, _nb(h, block_size)), dtype=scale_dtype(scale_mode))
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
    if x.is_cuda:
        return quantize_permute_mask_triton(x, routing_map, num_out_tokens, align_size, probs,
                                            block_size, fp8_dtype, scale_mode, scale)
    rid, fill = ops.make_row_id_map(routing_map, num_out_tokens, False, align_size)
    return (*ops.quantize_permute(x, rid, probs, num_out_tokens, block_size, fp8_dtype,
                                  scale_mode, scale, fill), rid)


@_quantize_permute_mask.register_fake
def _(x, routing_map, probs, num_out_tokens, align_size, block_size, fp8_dtype, scale_mode,
      scale):
    C.check_quantize_args("quantize_permute_mask", x, block_size, fp8_dtype, scale_mode, scale)
    t, e = routing_map.shape
    rid = routing_map.new_empty((t, 2 * e + 1), dtype=torch.int32)
    return (*ops.quantize_permute(x, rid, probs, num_out_tokens, block_size, fp8_dtype,
                                  scale_mode, scale), rid)


def _setup(ctx, inputs, output):
    """Both fused ops: ``probs`` is input 2; the map is input 1 (``quantize_permute``) or
    output 3 (``quantize_permute_mask``), and it, the bits and the scales take no grad."""
    probs = inputs[2]
    rid = output[3] if len(output) == 4 else inputs[1]
    ctx.mark_non_differentiable(*output[:2], *output[3:])
    ctx.save_for_backward(rid)
    ctx.probs_meta = None if probs is None else (tuple(probs.shape), probs.dtype)


def _backward(ctx, grad_q, grad_scale, grad_probs, *grad_map):
    from qmoe.ops.permute import probs_grad

    (rid,) = ctx.saved_tensors
    gp = None
    if ctx.probs_meta is not None and grad_probs is not None:
        (t, p), dtype = ctx.probs_meta
        gp = probs_grad(rid, grad_probs, t, p, dtype)
    return None, None, gp, None, None, None, None, None, None  # 9 inputs each


_quantize_permute.register_autograd(_backward, setup_context=_setup)
_quantize_permute_mask.register_autograd(_backward, setup_context=_setup)


def _map_in_launch(x, is_index: bool, n: int) -> bool:
    """Whether ``quantize_permute_mask`` (CUDA, mask map, N >= MASK_MAP_MIN_ROWS_PER_TOKEN
    * T) serves the call."""
    return (not is_index and x.is_cuda
            and n >= MASK_MAP_MIN_ROWS_PER_TOKEN * max(x.shape[0], 1))


class _QuantizePermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, probs, routing_map, is_index, align_size, n, recipe, scale):
        if isinstance(recipe, PerTensor):
            s = per_tensor_scale(x, recipe) if scale is None else scale.float().reshape(())
            mode, bs = "given", 0
        else:
            s, mode, bs = None, recipe_scale_mode(recipe), recipe.block_size
        args = (n, bs, recipe.fp8_dtype, mode, s)
        if _map_in_launch(x, is_index, n):
            q, s_out, pp, rid = ops.quantize_permute_mask(x, routing_map, probs, n,
                                                          align_size, *args[1:])
        else:
            rid, fill = ops.make_row_id_map(routing_map, n, is_index, align_size)
            q, s_out, pp = ops.quantize_permute(x, rid, probs, *args, fill)
        ctx.save_for_backward(rid)
        ctx.mark_non_differentiable(rid)
        ctx.probs_meta = None if probs is None else (tuple(probs.shape), probs.dtype)
        if isinstance(recipe, PerTensor):
            out = Float8Tensor(q, s_out, x.dtype)
        elif isinstance(recipe, MXFP8):
            out = MXFP8Tensor(q, s_out, x.dtype)
        else:
            out = Float8BlockwiseTensor(q, s_out, x.dtype, recipe.block_size)
        return out, pp, rid

    @staticmethod
    def backward(ctx, grad_out, grad_pp, grad_rid):
        from qmoe.ops.permute import permute_grads

        (rid,) = ctx.saved_tensors
        gx, gp = permute_grads(rid, plain_grad(grad_out), grad_pp, ctx.probs_meta)
        return gx, gp, None, None, None, None, None, None


def quantize_and_permute(fn: str, x, probs, routing_map, is_index: bool, align_size: int, n,
                         recipe: Recipe, scale):
    """The public functions' fused path: ``(quantized output [N, H], permuted_probs,
    row_id_map)``."""
    from qmoe.tensors.base import QuantizedTensor

    if isinstance(x, QuantizedTensor) or type(x).__module__.startswith("torchao"):
        raise TypeError(f"{fn}: inp is already quantized ({type(x).__name__}); pass it "
                        "without quantize=, or pass the high-precision tokens")
    if not isinstance(recipe, (PerTensor, Blockwise, MXFP8)):
        raise TypeError(f"{fn}: quantize must be qmoe.PerTensor(), qmoe.Blockwise() or "
                        f"qmoe.MXFP8(), got {recipe!r}")
    if scale is not None:
        if not isinstance(recipe, PerTensor):
            raise ValueError(f"{fn}: quantize_scale is only accepted with the PerTensor recipe")
        check_given_scale(fn, "quantize_scale", scale, "inp", x)
    return _QuantizePermute.apply(x, probs, routing_map, is_index, align_size, n, recipe,
                                  scale)

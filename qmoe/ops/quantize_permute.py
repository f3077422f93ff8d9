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
from qmoe.ops.row_id_map import num_slots
from qmoe.tensors.quantize import (
    EPS,
    SCALE_MODES,
    _emax_elem,
    _plain,
    _scale_mode,
    per_tensor_scale,
)
from qmoe.tensors.recipes import MXFP8, Blockwise, PerTensor, Recipe, fp8_max
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
    s_out = s.clone() if scale_mode == "given" else ops.permute(s, rid, None, n)[0]
    return bits.view(fp8_dtype), s_out, pp if probs is not None else x.new_empty(0)


def quantize_permute_triton(x, rid, probs, n, block_size, fp8_dtype, scale_mode, scale,
                            fill=None, *, tile=None, kb=4, num_warps=4, poison=False):
    """The fused kernel (CUDA, or CPU under TRITON_INTERPRET=1); outputs as the op's.
    ``fill``: as ``permute_rows``'s (zero the unwritten rows in the same launch).
    ``tile`` (row elements per program), ``kb`` and ``num_warps`` set the kernel's tiling
    (``benchmarks/sweep_permute.py`` sweeps them). ``poison`` (tests) fills the outputs
    with 0xFF bytes first, so a row the kernel misses shows."""
    from qmoe.ops._kernels.permute import zero_rows_kernel
    from qmoe.ops._kernels.quantize_permute import quantize_permute_kernel
    from qmoe.ops.backend import scatter_programs

    t, h = x.shape
    if h == 0:
        return _two_step(x, rid, probs, n, block_size, fp8_dtype, scale_mode, scale)
    given = scale_mode == "given"
    bs = 512 if given else block_size  # per-tensor: the block is only the tile width
    nb = _nb(h, bs)
    q = torch.empty((n, h), dtype=torch.uint8, device=x.device)
    if given:
        s_out = scale.float().reshape(()).clone()
    else:
        sdt = torch.uint8 if scale_mode == "mx_floor" else torch.float32
        s_out = torch.empty((n, nb), dtype=sdt, device=x.device)
    has_p = probs is not None
    pp = probs.new_empty((n,)) if has_p else x.new_empty(0)
    if poison:
        for buf in (q, pp) if given else (q, s_out, pp):
            buf.view(torch.uint8).fill_(0xFF)
    if n == 0:
        return q.view(fp8_dtype), s_out, pp
    if x.stride(1) != 1:
        x = x.contiguous()
    has_f = fill is not None
    written = fill if has_f else torch.zeros(n, dtype=torch.int8, device=x.device)
    if tile is None:  # row elements per program (sweep_permute.py: 4096 at H >= 4096)
        tile = 4096 if h >= 4096 else 1024
    groups = max(1, min(tile // bs, next_pow2(nb)))
    e4m3 = fp8_dtype == torch.float8_e4m3fn
    progs, r, z = scatter_programs(t, n, fill)
    if progs:
        quantize_permute_kernel[(progs, cdiv(nb, groups))](
            x, q, s_out, rid, probs if has_p else x, pp if has_p else written, written,
            fill if has_f else written, t, n, h, nb, num_slots(rid), r, z, x.stride(0),
            probs.stride(0) if has_p else 0,
            FP8_MAX=fp8_max(fp8_dtype), EMAX_ELEM=_emax_elem(fp8_dtype), EPS=EPS,
            SCALE_MODE=3 if given else SCALE_MODES[scale_mode], MB=3 if e4m3 else 2,
            BIAS=7 if e4m3 else 15, HW_CAST=x.is_cuda, HAS_P=has_p, HAS_FILL=has_f, BS=bs,
            GROUPS=groups, KB=kb, num_warps=num_warps,
        )
    if not has_f:
        zero_rows_kernel[(cdiv(n, 64),)](
            q, written, pp if has_p else written, written if given else s_out, n, h,
            0 if given else nb, HAS_P=has_p, HAS_SIDE=not given, BLOCK_R=64, BLOCK_H=64,
            BLOCK_S=next_pow2(nb), num_warps=4,
        )
    return q.view(fp8_dtype), s_out, pp


@define(
    "quantize_permute(Tensor x, Tensor row_id_map, Tensor? probs, SymInt num_out_tokens, "
    "int block_size, ScalarType fp8_dtype, str scale_mode, Tensor? scale, Tensor? fill=None) "
    "-> (Tensor, Tensor, Tensor)"
)
def _quantize_permute(x, row_id_map, probs, num_out_tokens, block_size, fp8_dtype,
                      scale_mode, scale, fill=None):
    """``(qdata [N, H] fp8, scale [N, NB] fp32 / uint8 e8m0 bits, or [] given,
    permuted_probs [N] or empty)``. ``fill``: the map's unwritten row ranges, or None.
    No host sync."""
    if x.is_cuda:
        return quantize_permute_triton(x, row_id_map, probs, num_out_tokens, block_size,
                                       fp8_dtype, scale_mode, scale, fill)
    return _two_step(x, row_id_map, probs, num_out_tokens, block_size, fp8_dtype, scale_mode,
                     scale)


@_quantize_permute.register_fake
def _(x, row_id_map, probs, num_out_tokens, block_size, fp8_dtype, scale_mode, scale,
      fill=None):
    n, h = num_out_tokens, x.shape[1]
    q = x.new_empty((n, h), dtype=fp8_dtype)
    if scale_mode == "given":
        s = x.new_empty((), dtype=torch.float32)
    else:
        sdt = torch.uint8 if scale_mode == "mx_floor" else torch.float32
        s = x.new_empty((n, _nb(h, block_size)), dtype=sdt)
    pp = probs.new_empty((n,)) if probs is not None else x.new_empty(0)
    return q, s, pp


class _QuantizePermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, probs, rid, fill, n, recipe, scale):
        if isinstance(recipe, PerTensor):
            s = per_tensor_scale(x, recipe) if scale is None else scale.float().reshape(())
            mode, bs = "given", 0
        else:
            s, mode, bs = None, _scale_mode(recipe), recipe.block_size
        q, s_out, pp = ops.quantize_permute(x, rid, probs, n, bs, recipe.fp8_dtype, mode, s,
                                            fill)
        ctx.save_for_backward(rid)
        ctx.probs_meta = None if probs is None else (tuple(probs.shape), probs.dtype)
        if isinstance(recipe, PerTensor):
            out = Float8Tensor(q, s_out, x.dtype)
        elif isinstance(recipe, MXFP8):
            out = MXFP8Tensor(q, s_out, x.dtype)
        else:
            out = Float8BlockwiseTensor(q, s_out, x.dtype, recipe.block_size)
        return out, pp

    @staticmethod
    def backward(ctx, grad_out, grad_pp):
        from qmoe.ops.permute import permute_grads

        (rid,) = ctx.saved_tensors
        gx, gp = permute_grads(rid, _plain(grad_out), grad_pp, ctx.probs_meta)
        return gx, gp, None, None, None, None, None


def quantize_and_permute(fn: str, x, probs, rid, fill, n, recipe: Recipe, scale):
    """The public functions' fused path: ``(quantized output [N, H], permuted_probs)``."""
    from qmoe.tensors.base import QuantizedTensor

    if isinstance(x, QuantizedTensor):
        raise TypeError(f"{fn}: inp is already quantized; pass it without quantize=, or pass "
                        "the high-precision tokens")
    if not isinstance(recipe, (PerTensor, Blockwise, MXFP8)):
        raise TypeError(f"{fn}: quantize must be qmoe.PerTensor(), qmoe.Blockwise() or "
                        f"qmoe.MXFP8(), got {recipe!r}")
    if scale is not None:
        if not isinstance(recipe, PerTensor):
            raise ValueError(f"{fn}: quantize_scale is only accepted with the PerTensor recipe")
        if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
            raise ValueError(f"{fn}: quantize_scale must be a one-element tensor")
        if scale.device != x.device:
            raise ValueError(f"{fn}: quantize_scale is on {scale.device} but inp is on "
                             f"{x.device}")
    return _QuantizePermute.apply(x, probs, rid, fill, n, recipe, scale)

"""``qmoe.swiglu``: the experts' gated activation ``silu(h[:, :F]) * h[:, F:]`` in one pass,
optionally quantized in the same pass for the down GEMM, and its backward in one pass.

Glossary: N rows, F the activation width, ``h [N, 2F]`` the gate-up GEMM's output.

Ops (Triton on CUDA, torch elsewhere; kernels in ``kernels/swiglu.py``):

* ``qmoe::swiglu(h) -> act [N, F]``, computed in fp32 and rounded once to h's dtype;
* ``qmoe::swiglu_quantize(h, block_size, fp8_dtype, scale_mode) -> (bits, scales)``: the
  bits of ``qmoe::quantize_blocks(swiglu(h), ...)``, without writing the activation;
* ``qmoe::swiglu_backward(grad, h) -> grad_h [N, 2F]``.

Written out in torch, SwiGLU's forward is two launches and its backward five, each a pass
over ``[N, F]`` (``python -m benchmarks bench moe_layer`` counts them in its kernel
split); here each is one pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qmoe._library import define
from qmoe.ops.kernels.swiglu import swiglu_backward_triton, swiglu_triton
from qmoe.tensors.base import QuantizedTensor, plain_grad, register_passthrough
from qmoe.tensors.quantize import (
    _quantize_blocks,
    check_block_args,
    dequantize,
    recipe_scale_mode,
)
from qmoe.tensors.quantize import quantize as quantize_tensor
from qmoe.tensors.recipes import MXFP8, Blockwise, PerTensor, RowWise, block_size_of
from qmoe.tensors.types import Float8BlockwiseTensor, MXFP8Tensor

__all__ = ["swiglu"]

_DTYPES = (torch.bfloat16, torch.float32)


def _check_h(op: str, h: torch.Tensor) -> None:
    if h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"qmoe::{op}: h must be [N, 2F] (the gate and up halves side by "
                         f"side), got {tuple(h.shape)}")
    if h.dtype not in _DTYPES:
        raise TypeError(f"qmoe::{op}: h must be bf16 or fp32, got {h.dtype}")


def _swiglu_reference(h: torch.Tensor) -> torch.Tensor:
    """fp32 math, one rounding to h's dtype (the kernels' rule; torch's eager
    ``F.silu(a) * b`` rounds twice). In place on one fp32 buffer: four passes."""
    f = h.shape[1] // 2
    act = F.silu(h[:, :f].to(torch.float32, copy=True), inplace=True)  # (fp32 h: a copy)
    return act.mul_(h[:, f:]).to(h.dtype)


@define("swiglu(Tensor h) -> Tensor")
def _swiglu(h):
    """``act [N, F]`` in h's dtype from ``h [N, 2F]`` (bf16 / fp32). Torch (CPU); one
    Triton launch on CUDA."""
    _check_h("swiglu", h)
    return _swiglu_reference(h)


@_swiglu.register_cuda
def _swiglu_cuda(h):
    _check_h("swiglu", h)
    return swiglu_triton(h)


@_swiglu.register_fake
def _(h):
    _check_h("swiglu", h)
    return h.new_empty((h.shape[0], h.shape[1] // 2))


@define("swiglu_quantize(Tensor h, int block_size, ScalarType fp8_dtype, str scale_mode) "
        "-> (Tensor, Tensor)")
def _swiglu_quantize(h, block_size, fp8_dtype, scale_mode):
    """``(bits [N, F] fp8, scales [N, ceil(F / block_size)])``: ``qmoe::quantize_blocks``
    of ``swiglu(h)``, bit for bit. Torch (CPU); one Triton launch on CUDA that never
    writes the activation."""
    _check_h("swiglu_quantize", h)
    check_block_args(h, block_size, fp8_dtype, scale_mode, "swiglu_quantize")
    return _quantize_blocks(_swiglu_reference(h), block_size, fp8_dtype, scale_mode)


@_swiglu_quantize.register_cuda
def _swiglu_quantize_cuda(h, block_size, fp8_dtype, scale_mode):
    _check_h("swiglu_quantize", h)
    check_block_args(h, block_size, fp8_dtype, scale_mode, "swiglu_quantize")
    return swiglu_triton(h, (block_size, fp8_dtype, scale_mode))


@_swiglu_quantize.register_fake
def _(h, block_size, fp8_dtype, scale_mode):
    _check_h("swiglu_quantize", h)
    check_block_args(h, block_size, fp8_dtype, scale_mode, "swiglu_quantize")
    act = h.new_empty((h.shape[0], h.shape[1] // 2))
    return _quantize_blocks(act, block_size, fp8_dtype, scale_mode)


def _check_backward(grad, h) -> None:
    _check_h("swiglu_backward", h)
    if grad.dim() != 2 or grad.shape[0] != h.shape[0] or 2 * grad.shape[1] != h.shape[1]:
        raise ValueError(f"qmoe::swiglu_backward: grad must be [N, F] for h [N, 2F] = "
                         f"{list(h.shape)}, got {tuple(grad.shape)}")


@define("swiglu_backward(Tensor grad, Tensor h) -> Tensor")
def _swiglu_backward(grad, h):
    """``grad_h [N, 2F]`` in h's dtype: the gradient of ``swiglu(h)`` given ``grad [N, F]``,
    fp32 math. Torch (CPU); one Triton launch on CUDA."""
    _check_backward(grad, h)
    f = grad.shape[1]
    a, b = h[:, :f].to(torch.float32, copy=True), h[:, f:]  # a is overwritten below
    g = grad.float()
    s = torch.sigmoid(a)
    silu = a * s
    out = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    # grad_a = g * b * s * (1 + a - silu), grad_b = g * silu; fp32 buffers reused in place
    out[:, :f] = a.sub_(silu).add_(1).mul_(s).mul_(g).mul_(b)
    out[:, f:] = silu.mul_(g)
    return out


@_swiglu_backward.register_cuda
def _swiglu_backward_cuda(grad, h):
    _check_backward(grad, h)
    return swiglu_backward_triton(grad, h)


@_swiglu_backward.register_fake
def _(grad, h):
    _check_backward(grad, h)
    return h.new_empty(h.shape)


@register_passthrough(torch.ops.qmoe.swiglu_backward.default)
def _swiglu_backward_quantized(func, args, kwargs):
    """A quantized gradient (under compile AOTAutograd may hand the quantized output's
    tangent in as its subclass) is dequantized explicitly, not by the warning fallback."""
    grad, h = args
    return func(dequantize(grad, h.dtype), h)


# ---------------------------------------------------------------------- autograd
class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, recipe):
        ctx.save_for_backward(h)
        if recipe is None:
            return _swiglu(h)
        bs = block_size_of(recipe, h.shape[1] // 2)
        q, s = _swiglu_quantize(h, bs, recipe.fp8_dtype, recipe_scale_mode(recipe))
        if isinstance(recipe, MXFP8):
            return MXFP8Tensor(q, s, h.dtype)
        return Float8BlockwiseTensor(q, s, h.dtype, bs)

    @staticmethod
    def backward(ctx, grad):
        (h,) = ctx.saved_tensors
        return _swiglu_backward(plain_grad(grad).to(h.dtype), h), None


def swiglu(h: torch.Tensor, *, quantize=None) -> torch.Tensor:
    """``silu(h[:, :F]) * h[:, F:]``, the experts' SwiGLU, in fp32 rounded once.

    Args:
        h: ``[N, 2F]`` bf16 (or fp32), the gate-up GEMM's output: the gate in the first F
            columns, the up projection in the last F. Differentiable.
        quantize: optional block recipe (``qmoe.RowWise()``, ``Blockwise()``, ``MXFP8()``):
            return the activation quantized in the same pass, a ``Float8BlockwiseTensor``
            / ``MXFP8Tensor`` holding the bits ``qmoe.quantize(swiglu(h), recipe)`` gives.
            ``PerTensor`` (one scale over all rows) needs the whole activation's amax
            first: it is computed, then quantized (two passes).

    Returns ``[N, F]`` in h's dtype, or the quantized tensor (its gradient passes straight
    through, as ``qmoe.quantize``'s). No host sync.
    """
    if not isinstance(h, torch.Tensor) or isinstance(h, QuantizedTensor):
        raise TypeError(f"swiglu: h must be a plain [N, 2F] tensor, got {type(h).__name__}")
    _check_h("swiglu", h)
    if quantize is not None and not isinstance(quantize, (RowWise, Blockwise, MXFP8,
                                                          PerTensor)):
        raise TypeError(f"swiglu: quantize must be None or a qmoe recipe (RowWise(), "
                        f"Blockwise(), MXFP8(), PerTensor()), got {quantize!r}")
    if isinstance(quantize, PerTensor):
        return quantize_tensor(_SwiGLU.apply(h, None), quantize)
    return _SwiGLU.apply(h, quantize)

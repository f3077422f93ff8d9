"""``quantize``: high-precision tensor -> FP8 subclass, as custom ops with a Triton path.

Three custom ops do the work; ``quantize`` wraps them in an autograd function whose
backward is straight-through (the gradient reaches ``x`` unchanged, in its dtype):

* ``qmoe::quantize_blocks(x, block_size, fp8_dtype, scale_mode) -> (qdata, scale)``:
  ``x`` ``[..., H]`` -> ``qdata`` ``[..., H]`` fp8 and ``scale`` ``[..., ceil(H/bs)]``
  (fp32, or e8m0 bits as ``uint8`` for the MX modes ``"mx_floor"`` and ``"mx_rceil"``:
  Inductor's CPU backend cannot copy e8m0 tensors, so graphs carry the bits). One pass
  over ``x`` on CUDA.
* ``qmoe::quantize_with_scale(x, scale, fp8_dtype) -> qdata``: per-tensor, given a
  ``[]`` fp32 scale.
* ``qmoe::per_tensor_scale``: the dynamic per-tensor recipe's scale, from the amax of
  ``x`` (``vector_norm(x, inf)``: a device reduction with no ``|x|`` temporary, no host
  sync).

On CPU the first two run the C++ kernels (``csrc/``, when built) or else the torch
reference below; on CUDA the Triton kernel in ``qmoe/tensors/kernels/quantize.py``. The
scale op is torch code on every device.
"""

from __future__ import annotations

import torch

from qmoe._intmath import cdiv
from qmoe._library import NO_GRAD, define, eager_route
from qmoe.tensors.base import QuantizedTensor, expand_block_scales, plain_grad
from qmoe.tensors.kernels.quantize import dequantize_rows_triton, quantize_rows_triton
from qmoe.tensors.layouts import (
    EPS,
    FP8_DTYPES,
    HP_DTYPES,
    OP_BLOCK_SIZES,
    SCALE_MODES,
    emax_elem,
    scale_dtype,
)
from qmoe.tensors.recipes import (
    MXFP8,
    Blockwise,
    PerTensor,
    Recipe,
    RowWise,
    block_size_of,
    fp8_max,
)
from qmoe.tensors.tuning import PER_TENSOR_BLOCK
from qmoe.tensors.types import Float8BlockwiseTensor, Float8Tensor, MXFP8Tensor

__all__ = ["quantize", "dequantize", "quantize_reference"]

_F32_MIN_NORMAL = 2.0**-126


def _pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """Round positive fp32 ``s`` up to a power of two, exactly (bit arithmetic)."""
    bits = (s.view(torch.int32) + 0x7FFFFF) & 0x7F800000
    return torch.where(s.isnan(), s, bits.view(torch.float32))


def _canonical_nan(s: torch.Tensor) -> torch.Tensor:
    """Every NaN as 0x7FC00000: GPUs and CPUs produce different NaN bit patterns."""
    return torch.where(s.isnan(), float("nan"), s)


# --------------------------------------------------------------------- reference
def _saturate_cast(y: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Saturate to +-fp8_max and round to nearest even. Every NaN becomes the positive
    NaN 0x7F (the GPU's conversion gives that; x86 makes inf/inf a negative NaN)."""
    m = fp8_max(fp8_dtype)
    y = torch.where(y.isnan(), float("nan"), y.clamp(-m, m))
    return y.to(fp8_dtype)


def _reference_blocks(x, block_size, fp8_dtype, scale_mode):
    h = x.shape[-1]
    nb = cdiv(h, block_size)
    xf = x.float()
    pad = nb * block_size - h
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    xb = xf.reshape(*x.shape[:-1], nb, block_size)
    amax = xb.abs().amax(-1) if xb.numel() else xb.new_zeros(xb.shape[:-1])
    if scale_mode == "mx_floor":
        exp = ((amax.view(torch.int32) >> 23) & 0xFF) - 127
        # a nonzero block's exponent stops at -126 (byte 1): its elements are divided by
        # 2**-126 (below, as torchao), and byte 0 (2**-127) would give them back at half
        # their value; an all-zero block keeps byte 0
        low = (amax > 0).int() - 127  # int32, as exp
        biased = torch.maximum(exp - emax_elem(fp8_dtype), low).clamp(max=128) + 127
        biased = torch.where(amax.isnan(), 255, biased)
        scale_out = biased.to(torch.uint8)  # e8m0 bits
        divisor = (biased << 23).view(torch.float32).clamp(min=_F32_MIN_NORMAL)
    elif scale_mode == "mx_rceil":
        biased = _rceil_bytes(amax, fp8_max(fp8_dtype))
        scale_out = biased.to(torch.uint8)
        # byte 0 (amax <= fp8_max * 2**-127) divides by 1, as TE and torchao do: its
        # elements round to +-0; 255 (NaN) makes every element NaN, as torchao's
        divisor = torch.where(biased == 0, 1.0, (biased << 23).view(torch.float32))
        divisor = torch.where(biased == 255, float("nan"), divisor)
    else:
        divisor = amax.clamp(min=EPS) / fp8_max(fp8_dtype)
        if scale_mode == "pow2":
            divisor = _pow2_ceil(divisor)
        divisor = _canonical_nan(divisor)
        scale_out = divisor
    q = _saturate_cast(xb / divisor.unsqueeze(-1), fp8_dtype)
    q = q.reshape(*x.shape[:-1], nb * block_size)[..., :h]
    if q.numel() == 0:  # .contiguous() keeps the padded strides of an empty view
        q = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    return q.contiguous(), scale_out


def _rceil_bytes(amax: torch.Tensor, fp8_max_value: float) -> torch.Tensor:
    """TransformerEngine's MXFP8 scale (NVIDIA's RCEIL, ``cvt.rp.satfinite.ue8m0``) as
    int32 e8m0 bytes: ``amax / fp8_max`` in fp32, rounded up to a power of two (a
    subnormal quotient up to ``2**-127``, byte 0, or ``2**-126``), saturated at 254 (an
    infinite amax); 255 for NaN, 0 for an all-zero block."""
    d = amax / fp8_max_value
    bits = d.view(torch.int32)
    e, m = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    up = (m > 0) & (e != 0xFE) & ((e != 0) | (m > 0x400000))
    biased = torch.where(e == 0xFF, 254, e + up.int())
    return torch.where(amax.isnan(), 255, biased)


def per_tensor_scale(x: torch.Tensor, recipe: PerTensor) -> torch.Tensor:
    """The dynamic per-tensor scale ``max(amax, EPS) / fp8_max`` as a ``[]`` fp32 tensor
    (not differentiable: ``x`` is detached). One custom op, so ``torch.compile`` runs this
    same code: Inductor would fuse the division into its own Triton kernel, whose fp32
    division is not correctly rounded (1 ulp off eager on CUDA, seen on the H200)."""
    return _per_tensor_scale(x.detach(), fp8_max(recipe.fp8_dtype), recipe.power_of_two_scale)


@define("per_tensor_scale(Tensor x, float fp8_max_value, bool pow2) -> Tensor")
def _per_tensor_scale(x: torch.Tensor, fp8_max_value: float, pow2: bool) -> torch.Tensor:
    if x.numel() == 0:
        amax = x.new_zeros((), dtype=torch.float32)
    else:  # one read of x, no |x| temporary; NaN propagates
        amax = torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)
    # Divided by a tensor, not a Python number: CUDA divides by a scalar as a multiply by
    # its reciprocal (1 ulp off the CPU's correctly rounded quotient at times).
    s = amax.clamp(min=EPS) / torch.full_like(amax, fp8_max_value)
    return _canonical_nan(_pow2_ceil(s) if pow2 else s)


@_per_tensor_scale.register_fake
def _(x, fp8_max_value, pow2):
    return x.new_empty((), dtype=torch.float32)


def quantize_reference(x: torch.Tensor, recipe: Recipe, scale: torch.Tensor | None = None):
    """Pure-torch reference of :func:`quantize`: returns ``(qdata, scale)`` plain tensors."""
    if isinstance(recipe, PerTensor):
        s = per_tensor_scale(x, recipe) if scale is None else scale.float()
        return _saturate_cast(x.float() / s, recipe.fp8_dtype), s
    q, s = _reference_blocks(x, block_size_of(recipe, x.shape[-1]), recipe.fp8_dtype,
                             recipe_scale_mode(recipe))
    return q, s.view(torch.float8_e8m0fnu) if isinstance(recipe, MXFP8) else s


# -------------------------------------------------------------------- custom ops
def check_op_dtypes(op: str, x: torch.Tensor, fp8_dtype: torch.dtype) -> None:
    """The direct ops' dtypes (``qmoe.quantize`` checks them before), as the C++ ops do."""
    if x.dtype not in HP_DTYPES:
        raise TypeError(f"qmoe::{op}: x must be fp32, bf16 or fp16, got {x.dtype}")
    if fp8_dtype not in FP8_DTYPES:
        raise TypeError(f"qmoe::{op}: fp8_dtype must be torch.float8_e4m3fn or "
                        f"torch.float8_e5m2, got {fp8_dtype}")


def check_block_args(x, block_size, fp8_dtype, scale_mode, op="quantize_blocks") -> None:
    """A direct op's block arguments (``qmoe.quantize`` builds them from a checked recipe)."""
    check_op_dtypes(op, x, fp8_dtype)
    lo, hi = OP_BLOCK_SIZES
    if not (isinstance(block_size, int) and lo <= block_size <= hi
            and block_size & (block_size - 1) == 0):
        raise ValueError(f"qmoe::{op}: block_size must be a power of two in [{lo}, {hi}], "
                         f"got {block_size!r}")
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"qmoe::{op}: scale_mode must be one of {sorted(SCALE_MODES)}, got "
                         f"{scale_mode!r}")


@define(
    "quantize_blocks(Tensor x, int block_size, ScalarType fp8_dtype, str scale_mode) "
    "-> (Tensor, Tensor)"
)
def _quantize_blocks(
    x: torch.Tensor, block_size: int, fp8_dtype: torch.dtype, scale_mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qdata [..., H] fp8, scale [..., ceil(H / block_size)])`` (fp32, or e8m0 bits as
    uint8 for the MX modes). Torch (CPU); one Triton launch on CUDA."""
    check_block_args(x, block_size, fp8_dtype, scale_mode)
    return _reference_blocks(x, block_size, fp8_dtype, scale_mode)


@_quantize_blocks.register_cuda
def _quantize_blocks_cuda(x, block_size, fp8_dtype, scale_mode):
    check_block_args(x, block_size, fp8_dtype, scale_mode)
    return quantize_rows_triton(x, block_size, fp8_dtype, scale_mode)


@_quantize_blocks.register_fake
def _(x, block_size, fp8_dtype, scale_mode):
    check_block_args(x, block_size, fp8_dtype, scale_mode)
    sdt = scale_dtype(scale_mode)
    nb = cdiv(x.shape[-1], block_size)
    return (
        torch.empty(x.shape, dtype=fp8_dtype, device=x.device),
        x.new_empty((*x.shape[:-1], nb), dtype=sdt),
    )


@define("quantize_with_scale(Tensor x, Tensor scale, ScalarType fp8_dtype) -> Tensor")
def _quantize_with_scale(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype
) -> torch.Tensor:
    """``qdata [..., H]`` fp8: ``x / scale`` saturated (``scale`` one fp32 element). Torch
    (CPU); one Triton launch on CUDA."""
    check_op_dtypes("quantize_with_scale", x, fp8_dtype)
    return _saturate_cast(x.float() / scale.float(), fp8_dtype)


@_quantize_with_scale.register_cuda
def _quantize_with_scale_cuda(x, scale, fp8_dtype):
    check_op_dtypes("quantize_with_scale", x, fp8_dtype)
    return quantize_rows_triton(x, PER_TENSOR_BLOCK, fp8_dtype, "given", scale.float())[0]


@_quantize_with_scale.register_fake
def _(x, scale, fp8_dtype):
    check_op_dtypes("quantize_with_scale", x, fp8_dtype)
    return torch.empty(x.shape, dtype=fp8_dtype, device=x.device)


def _check_dequantize_args(bits, fp8_dtype, scale, block_size, dtype) -> None:
    if bits.dtype != torch.uint8 or fp8_dtype not in FP8_DTYPES or scale.dtype != torch.float32:
        raise TypeError(f"qmoe::dequantize_blocks: bits must be uint8 (fp8 bits viewed), "
                        f"fp8_dtype an fp8 dtype and scale fp32, got {bits.dtype}, "
                        f"{fp8_dtype} and {scale.dtype}")
    if dtype not in HP_DTYPES:
        raise TypeError(f"qmoe::dequantize_blocks: dtype must be fp32, bf16 or fp16, got "
                        f"{dtype}")
    if bits.dim() == 0 or not (isinstance(block_size, int) and block_size >= 1):
        raise ValueError(f"qmoe::dequantize_blocks: bits must be [..., H] and block_size a "
                         f"positive int, got {tuple(bits.shape)} and {block_size!r}")
    want = (*bits.shape[:-1], cdiv(bits.shape[-1], block_size))
    if scale.dim() != 0 and tuple(scale.shape) != want:
        raise ValueError(f"qmoe::dequantize_blocks: scale must be [] or {list(want)} for "
                         f"bits {tuple(bits.shape)} in blocks of {block_size}, got "
                         f"{tuple(scale.shape)}")


@define("dequantize_blocks(Tensor bits, ScalarType fp8_dtype, Tensor scale, int block_size, "
        "ScalarType dtype) -> Tensor")
def _dequantize_blocks(bits, fp8_dtype, scale, block_size, dtype):
    """``bits [..., H]`` (uint8 view of ``fp8_dtype`` values) times fp32 ``scale``
    (``[..., ceil(H / block_size)]`` block scales, or ``[]`` per tensor), rounded once to
    ``dtype``: ``QuantizedTensor``'s dequantize on CUDA. Torch (CPU); one Triton launch on
    CUDA, one pass (torch's ``qdata.float() * scale`` then ``.to(dtype)`` writes fp32
    twice in between)."""
    _check_dequantize_args(bits, fp8_dtype, scale, block_size, dtype)
    if scale.dim():
        scale = expand_block_scales(scale, bits.shape[-1], block_size)
    return (bits.view(fp8_dtype).float() * scale).to(dtype)


@_dequantize_blocks.register_cuda
def _dequantize_blocks_cuda(bits, fp8_dtype, scale, block_size, dtype):
    _check_dequantize_args(bits, fp8_dtype, scale, block_size, dtype)
    return dequantize_rows_triton(bits.view(fp8_dtype), scale, block_size, dtype)


@_dequantize_blocks.register_fake
def _(bits, fp8_dtype, scale, block_size, dtype):
    _check_dequantize_args(bits, fp8_dtype, scale, block_size, dtype)
    return torch.empty(bits.shape, dtype=dtype, device=bits.device)


def recipe_scale_mode(recipe: Recipe) -> str:
    """The ``scale_mode`` (a key of ``SCALE_MODES``) of a block recipe (``Blockwise``,
    ``RowWise``, ``MXFP8``)."""
    if isinstance(recipe, MXFP8):
        return "mx_" + recipe.scale_rounding
    return "pow2" if recipe.power_of_two_scale else "amax"


# ---------------------------------------------------------------------- autograd
def wrap_quantized(recipe: Recipe, qdata: torch.Tensor, scale: torch.Tensor,
                   orig_dtype: torch.dtype, block_size: int):
    """The recipe's quantized type around ``qdata`` (fp8) and ``scale`` (the per-tensor
    ``[]``, or block scales of ``block_size``, which a per-tensor or MX type ignores)."""
    if isinstance(recipe, PerTensor):
        return Float8Tensor(qdata, scale, orig_dtype)
    if isinstance(recipe, MXFP8):
        return MXFP8Tensor(qdata, scale, orig_dtype)
    return Float8BlockwiseTensor(qdata, scale, orig_dtype, block_size)


def _quantize(x, recipe, scale):
    """``quantize``'s result without autograd (``_Quantize``'s forward, and eager calls
    that need no gradient)."""
    if isinstance(recipe, PerTensor):
        # a given scale is copied: a delayed-scaling update of the caller's tensor in
        # place must not change tensors already quantized with it (as the fused path)
        s = per_tensor_scale(x, recipe) if scale is None else (
            scale.detach().float().reshape(()).clone())
        return wrap_quantized(recipe, _quantize_with_scale(x, s, recipe.fp8_dtype), s,
                              x.dtype, 0)
    bs = block_size_of(recipe, x.shape[-1])
    q, s = _quantize_blocks(x, bs, recipe.fp8_dtype, recipe_scale_mode(recipe))
    return wrap_quantized(recipe, q, s, x.dtype, bs)


class _Quantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, recipe, scale):
        return _quantize(x, recipe, scale)

    @staticmethod
    def backward(ctx, grad):
        return plain_grad(grad), None, None


def quantize(
    x: torch.Tensor, recipe: Recipe, *, scale: torch.Tensor | None = None
) -> Float8Tensor | Float8BlockwiseTensor | MXFP8Tensor:
    """Quantize ``x`` ``[..., H]`` (fp32 / bf16 / fp16) with ``recipe``.

    Returns a :class:`Float8Tensor` (``PerTensor``), :class:`Float8BlockwiseTensor`
    (``Blockwise``; ``RowWise``, one block of ``next_pow2(H)`` per row) or
    :class:`MXFP8Tensor` (``MXFP8``) whose ``orig_dtype`` is ``x.dtype``. ``scale``
    (``PerTensor`` only): a caller-given one-element scale (any shape), e.g. from delayed
    scaling, which skips the amax pass. No host sync.
    Differentiable: the backward passes the gradient straight through to ``x``.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize: x must be a torch.Tensor, got {type(x).__name__}")

    if isinstance(x, QuantizedTensor):
        raise TypeError("quantize: x is already quantized; dequantize() it first")
    if x.dtype not in HP_DTYPES:
        raise TypeError(f"quantize: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("quantize: x must have at least one dim [..., H], got a scalar")
    if not isinstance(recipe, (PerTensor, Blockwise, RowWise, MXFP8)):
        raise TypeError(
            "quantize: recipe must be qmoe.PerTensor(), qmoe.Blockwise(), qmoe.RowWise() or "
            f"qmoe.MXFP8(), got {recipe!r}"
        )
    if isinstance(recipe, RowWise):
        block_size_of(recipe, x.shape[-1])  # (a row too wide raises here, by name)
    if scale is not None:
        if not isinstance(recipe, PerTensor):
            raise ValueError("quantize: scale= is only accepted with the PerTensor recipe")
        check_given_scale("quantize", "scale", scale, "x", x)
    if eager_route((x,)) == NO_GRAD:  # no gradient to attach: skip the Function's layer
        return _quantize(x, recipe, scale)
    return _Quantize.apply(x, recipe, scale)


def check_given_scale(fn: str, name: str, scale, x_name: str, x: torch.Tensor) -> None:
    """A caller-given per-tensor scale (``quantize``'s ``scale``, the permutes'
    ``quantize_scale``): ``check_scale_tensor``, and a value positive and finite as the
    fp32 the kernels use (a float64 scale out of fp32's range becomes 0 or inf there). The
    value is checked where that is free (a CPU tensor in eager mode); on CUDA it is not (a
    device check would add launches to every call)."""
    check_scale_tensor(fn, name, scale, x_name, x)
    if scale.device.type == "cpu" and not torch.compiler.is_compiling():
        s = scale.reshape(())
        v = float(s.float())
        if not (v > 0 and v != float("inf")):
            given = "" if s.dtype == torch.float32 else f" (given {float(s)!r} as {s.dtype})"
            raise ValueError(f"{fn}: {name} must be positive and finite as float32, got "
                             f"{v}{given}; a zero, negative or non-finite scale would quantize "
                             "to zeros or NaN")


def check_scale_tensor(fn: str, name: str, scale, x_name: str, x: torch.Tensor) -> None:
    """A per-tensor scale's form: a one-element float tensor on ``x``'s device (no value
    read, so fake tensors pass: the fused ops' fakes check this too)."""
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a one-element float tensor, got "
                        f"{type(scale).__name__} (wrap a number as torch.tensor(v, "
                        f"device={x_name}.device))")
    if scale.numel() != 1:
        raise ValueError(f"{fn}: {name} must be a one-element tensor, got shape "
                         f"{tuple(scale.shape)}")
    if scale.device != x.device:
        raise ValueError(f"{fn}: {name} is on {scale.device} but {x_name} is on {x.device}")
    if not scale.is_floating_point():
        raise TypeError(f"{fn}: {name} must be a float tensor, got {scale.dtype}")


def dequantize(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t.dequantize(dtype)`` for qmoe tensors; plain tensors pass through (cast if asked)."""

    if isinstance(t, QuantizedTensor):
        return t.dequantize(dtype)
    return t if dtype is None else t.to(dtype)

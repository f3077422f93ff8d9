"""Quantization recipes: frozen, hashable descriptions of an FP8 layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qmoe._intmath import next_pow2
from qmoe.tensors.layouts import (
    BLOCKWISE_BLOCK_SIZE,
    BLOCKWISE_BLOCK_SIZES,
    FP8_DTYPES,
    MX_BLOCK_SIZE,
    OP_BLOCK_SIZES,
)

__all__ = ["PerTensor", "Blockwise", "RowWise", "MXFP8", "Recipe", "fp8_max", "block_size_of"]


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """Largest finite value of ``fp8_dtype`` (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(fp8_dtype).max)


def _check_pow2(recipe: str, flag) -> None:
    if not isinstance(flag, bool):
        raise TypeError(f"{recipe}: power_of_two_scale must be True or False, got {flag!r}")


def _check_fp8(recipe: str, fp8_dtype: torch.dtype) -> None:
    if fp8_dtype not in FP8_DTYPES:
        raise TypeError(
            f"{recipe}: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, "
            f"got {fp8_dtype!r}"
        )


@dataclass(frozen=True)
class PerTensor:
    """One fp32 scale for the whole tensor: ``scale = max(amax, 1e-12) / fp8_max``.

    ``power_of_two_scale`` rounds the scale up to a power of two (exact rescaling).
    A caller-given scale (``quantize(x, recipe, scale=s)``) skips the amax pass.
    """

    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    power_of_two_scale: bool = False

    def __post_init__(self) -> None:
        _check_fp8("PerTensor", self.fp8_dtype)
        _check_pow2("PerTensor", self.power_of_two_scale)


@dataclass(frozen=True)
class Blockwise:
    """One fp32 scale per ``1 x block_size`` block of the last dim (DeepSeek-V3: 128).

    ``scale = max(amax_block, 1e-12) / fp8_max``, optionally rounded up to a power of two.
    """

    block_size: int = BLOCKWISE_BLOCK_SIZE
    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    power_of_two_scale: bool = False

    def __post_init__(self) -> None:
        _check_fp8("Blockwise", self.fp8_dtype)
        _check_pow2("Blockwise", self.power_of_two_scale)
        bs = self.block_size
        lo, hi = BLOCKWISE_BLOCK_SIZES
        if not isinstance(bs, int) or bs < lo or bs > hi or bs & (bs - 1):
            raise ValueError(
                f"Blockwise: block_size must be a power of two in [{lo}, {hi}], got {bs!r}"
            )


@dataclass(frozen=True)
class RowWise:
    """One fp32 scale per row: ``scale = max(amax_row, 1e-12) / fp8_max``, optionally
    rounded up to a power of two: the layout of Hopper's row-wise FP8 GEMMs
    (``torch._scaled_grouped_mm``; ``qmoe.grouped_mm`` takes such rows as they are).

    The quantized tensor is a ``Float8BlockwiseTensor`` whose one block spans the row:
    ``block_size = next_pow2(H)`` (``block_size_of``), scales ``[..., 1]``; so every op
    that moves blockwise rows moves these. Rows of up to ``OP_BLOCK_SIZES``' bound (16384
    columns).
    """

    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    power_of_two_scale: bool = False

    def __post_init__(self) -> None:
        _check_fp8("RowWise", self.fp8_dtype)
        _check_pow2("RowWise", self.power_of_two_scale)


@dataclass(frozen=True)
class MXFP8:
    """OCP MX v1.0 FP8: one e8m0 scale per 1 x 32 block.

    ``scale_rounding="floor"`` is the spec's rule, ``X = 2 ** (floor(log2(amax)) -
    emax_elem)`` with ``emax_elem`` 8 (e4m3) or 15 (e5m2), the exponent clamped to the
    e8m0 range and NaN blocks given the NaN scale 255. Elements are ``x / X`` saturated
    to +-fp8_max and rounded to nearest even. The divisor is ``max(X, 2**-126)`` (as
    torchao's: fp32 ``2**-127`` is subnormal), and the stored byte is the divisor used: a
    nonzero block whose exponent falls below -126 (amax < ``2**-118`` e4m3, ``2**-111``
    e5m2) stores byte 1 where the spec gives 0; an all-zero block keeps byte 0. Against
    torchao's ``MXTensor.to_mx(..., scaling_mode=ScaleCalculationMode.FLOOR)``: the same
    fp8 bits everywhere, the same scale bytes except in those nonzero blocks, where
    torchao stores 0 and so dequantizes them at half their value.

    ``scale_rounding="rceil"`` is TransformerEngine's rule (NVIDIA's RCEIL, torchao's
    ``ScaleCalculationMode.RCEIL``): the scale is ``amax / fp8_max`` (fp32) rounded *up*
    to a power of two, so no element saturates; an infinite amax gives 254, NaN 255, an
    all-zero block 0. Elements are ``x / scale`` rounded to nearest even, except in byte-0
    blocks (amax <= ``fp8_max * 2**-127``), which TE and torchao divide by 1: their elements
    round to +-0. A NaN block's elements are all NaN, as torchao's. The rounding up is
    exact, as TE's code and the ``cvt.rp.satfinite.ue8m0x2.f32`` instruction do it; torchao's
    eager ``to_mx(..., scaling_mode=ScaleCalculationMode.RCEIL)`` takes ``ceil(log2(...))``
    in fp32, which misses by one where ``amax / fp8_max`` lies a few ulps above a power of
    two (docs/tensors.md); elsewhere the two agree bit for bit.

    The tensors carry no trace of the rule: the e8m0 bytes say what they mean.
    """

    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    scale_rounding: str = "floor"

    block_size = MX_BLOCK_SIZE

    def __post_init__(self) -> None:
        _check_fp8("MXFP8", self.fp8_dtype)
        if self.scale_rounding not in ("floor", "rceil"):
            raise ValueError(
                "MXFP8: scale_rounding must be 'floor' (OCP MX v1.0) or 'rceil' "
                f"(TransformerEngine's), got {self.scale_rounding!r}"
            )


Recipe = PerTensor | Blockwise | RowWise | MXFP8


def block_size_of(recipe: Blockwise | RowWise | MXFP8, h: int) -> int:
    """The scale block of a block recipe for rows of ``h`` columns: ``Blockwise``'s
    ``block_size``, MX's 32, ``RowWise``'s one block over the row, ``next_pow2(h)``
    (a ``ValueError`` past ``OP_BLOCK_SIZES``' bound)."""
    if not isinstance(recipe, RowWise):
        return recipe.block_size
    bs = next_pow2(max(h, 1))
    if bs > OP_BLOCK_SIZES[1]:
        raise ValueError(f"RowWise: rows of H={h} columns are wider than the {OP_BLOCK_SIZES[1]} "
                         "a row-wise scale covers for now; use qmoe.Blockwise() or "
                         "qmoe.PerTensor() for this width")
    return bs

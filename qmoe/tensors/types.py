"""The three FP8 layouts: per-tensor, 1 x 128 blockwise and 1 x 32 MX.

All three hold ``qdata`` ``[..., H]`` in ``float8_e4m3fn`` or ``float8_e5m2`` and
dequantize as ``qdata.float() * scale``, the scale broadcast over its block. H need not
be a multiple of the block: the last block of each row is partial.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from qmoe.tensors.base import QuantizedTensor, e8m0_to_fp32, rebuild_quantized
from qmoe.tensors.layouts import BLOCKWISE_BLOCK_SIZE, MX_BLOCK_SIZE, check_block_size

__all__ = ["Float8Tensor", "Float8BlockwiseTensor", "MXFP8Tensor"]


class Float8Tensor(QuantizedTensor):
    """FP8 data with one fp32 scale for the whole tensor.

    Fields: ``qdata`` ``[..., H]`` fp8, ``scale`` ``[]`` fp32, ``orig_dtype``.
    """

    tensor_attribute_names: ClassVar[tuple[str, ...]] = ("orig_dtype",)
    block_size = None

    def __new__(cls, qdata, scale, orig_dtype, *, requires_grad=False):
        return super().__new__(cls, qdata, scale, orig_dtype, requires_grad=requires_grad)


class Float8BlockwiseTensor(QuantizedTensor):
    """FP8 data with one fp32 scale per 1 x ``block_size`` block of the last dim.

    The DeepSeek-V3 activation layout (``block_size=128``). Fields: ``qdata`` ``[..., H]``
    fp8, ``scale`` ``[..., ceil(H / block_size)]`` fp32, ``orig_dtype``, ``block_size``.
    """

    tensor_attribute_names: ClassVar[tuple[str, ...]] = ("orig_dtype", "block_size")
    block_size: int

    def __new__(cls, qdata, scale, orig_dtype, block_size=BLOCKWISE_BLOCK_SIZE, *,
                requires_grad=False):
        check_block_size("Float8BlockwiseTensor", block_size)
        return super().__new__(
            cls, qdata, scale, orig_dtype, block_size, requires_grad=requires_grad
        )


class MXFP8Tensor(QuantizedTensor):
    """OCP MX FP8: one ``float8_e8m0fnu`` (power-of-two) scale per 1 x 32 block.

    Fields: ``qdata`` ``[..., H]`` fp8, ``scale`` ``[..., ceil(H / 32)]`` e8m0,
    ``orig_dtype``. The scale byte ``b`` means ``2 ** (b - 127)``; 255 is NaN.

    The scale is stored as its bits, ``scale_bits`` (``uint8``, the same bytes), and
    ``scale`` is an e8m0 view of them: Inductor's CPU backend cannot generate code that
    copies e8m0 tensors (cat, clone), so ops and compiled graphs move the bits.
    The constructor takes ``scale`` as e8m0 or as ``uint8`` bits.
    """

    tensor_data_names: ClassVar[tuple[str, ...]] = ("qdata", "scale_bits")
    tensor_attribute_names: ClassVar[tuple[str, ...]] = ("orig_dtype",)
    block_size = MX_BLOCK_SIZE
    scale_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.uint8,)
    scale_bits: torch.Tensor

    def __new__(cls, qdata, scale, orig_dtype, *, requires_grad=False):
        return super().__new__(cls, qdata, scale, orig_dtype, requires_grad=requires_grad)

    @classmethod
    def _store_scale(cls, scale: torch.Tensor) -> torch.Tensor:
        if scale.dtype == torch.float8_e8m0fnu:
            return scale.view(torch.uint8)
        if scale.dtype != torch.uint8:
            raise TypeError(
                f"MXFP8Tensor: scale must be float8_e8m0fnu (or its uint8 bits), got {scale.dtype}"
            )
        return scale

    @property
    def scale(self) -> torch.Tensor:  # type: ignore[override]
        return self.scale_bits.view(torch.float8_e8m0fnu)

    def scale_fp32(self) -> torch.Tensor:
        return e8m0_to_fp32(self.scale_bits)


for _cls in (Float8Tensor, Float8BlockwiseTensor, MXFP8Tensor):
    _cls.__module__ = "qmoe.tensors"

torch.serialization.add_safe_globals(
    [Float8Tensor, Float8BlockwiseTensor, MXFP8Tensor, rebuild_quantized])

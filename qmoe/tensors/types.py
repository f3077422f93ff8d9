"""The three FP8 layouts: per-tensor, 1 x 128 blockwise and 1 x 32 MX.

All three hold ``qdata`` ``[..., H]`` in ``float8_e4m3fn`` or ``float8_e5m2`` and
dequantize as ``qdata.float() * scale``, the scale broadcast over its block. H need not
be a multiple of the block: the last block of each row is partial.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from qmoe.tensors.base import QuantizedTensor

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

    def __new__(cls, qdata, scale, orig_dtype, block_size=128, *, requires_grad=False):
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
            raise ValueError(
                f"Float8BlockwiseTensor: block_size must be a positive int, got {block_size!r}"
            )
        return super().__new__(
            cls, qdata, scale, orig_dtype, block_size, requires_grad=requires_grad
        )


class MXFP8Tensor(QuantizedTensor):
    """OCP MX FP8: one ``float8_e8m0fnu`` (power-of-two) scale per 1 x 32 block.

    Fields: ``qdata`` ``[..., H]`` fp8, ``scale`` ``[..., ceil(H / 32)]`` e8m0,
    ``orig_dtype``. The scale byte ``b`` means ``2 ** (b - 127)``; 255 is NaN.
    """

    tensor_attribute_names: ClassVar[tuple[str, ...]] = ("orig_dtype",)
    block_size = 32
    scale_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float8_e8m0fnu,)

    def __new__(cls, qdata, scale, orig_dtype, *, requires_grad=False):
        return super().__new__(cls, qdata, scale, orig_dtype, requires_grad=requires_grad)


for _cls in (Float8Tensor, Float8BlockwiseTensor, MXFP8Tensor):
    _cls.__module__ = "qmoe.tensors"

torch.serialization.add_safe_globals([Float8Tensor, Float8BlockwiseTensor, MXFP8Tensor])

"""FP8 tensor subclasses: per-tensor, 1x128 blockwise and 1x32 MX layouts."""

from qmoe.tensors import aten_ops as _aten_ops  # noqa: F401  (registers the op table)
from qmoe.tensors.base import (
    QuantizedDispatchError,
    QuantizedFallbackWarning,
    QuantizedTensor,
    passthrough_ops,
    register_passthrough,
    strict_dispatch,
    unregister_passthrough,
)
from qmoe.tensors.quantize import dequantize, quantize, quantize_reference
from qmoe.tensors.recipes import MXFP8, Blockwise, PerTensor, Recipe, RowWise
from qmoe.tensors.types import Float8BlockwiseTensor, Float8Tensor, MXFP8Tensor

__all__ = [
    "QuantizedTensor",
    "Float8Tensor",
    "Float8BlockwiseTensor",
    "MXFP8Tensor",
    "PerTensor",
    "Blockwise",
    "RowWise",
    "MXFP8",
    "Recipe",
    "quantize",
    "dequantize",
    "quantize_reference",
    "register_passthrough",
    "unregister_passthrough",
    "passthrough_ops",
    "strict_dispatch",
    "QuantizedFallbackWarning",
    "QuantizedDispatchError",
]

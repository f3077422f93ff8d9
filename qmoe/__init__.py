"""qmoe: FP8 mixture-of-experts token permutation for PyTorch."""

from qmoe._backends import backends, load_cpp_kernels
from qmoe.interop import from_torchao, to_torchao
from qmoe.ops import (
    ExpertWeightsFP8,
    expert_offsets,
    grouped_mm,
    moe_permute,
    moe_permute_and_pad_with_probs,
    moe_permute_with_probs,
    moe_sort_chunks_by_index,
    moe_sort_chunks_by_index_with_probs,
    moe_unpermute,
    quantize_expert_weights,
    swiglu,
    tokens_per_expert,
)
from qmoe.tensors import (
    MXFP8,
    Blockwise,
    Float8BlockwiseTensor,
    Float8Tensor,
    MXFP8Tensor,
    PerTensor,
    QuantizedDispatchError,
    QuantizedFallbackWarning,
    QuantizedTensor,
    RowWise,
    dequantize,
    passthrough_ops,
    quantize,
    register_passthrough,
    strict_dispatch,
    unregister_passthrough,
)

load_cpp_kernels()  # dlopen of the prebuilt CPU kernels, when present; never compiles

__version__ = "0.1.0"

__all__ = [
    "tokens_per_expert",
    "expert_offsets",
    "grouped_mm",
    "quantize_expert_weights",
    "ExpertWeightsFP8",
    "swiglu",
    "backends",
    "from_torchao",
    "to_torchao",
    "moe_permute",
    "moe_permute_with_probs",
    "moe_permute_and_pad_with_probs",
    "moe_unpermute",
    "moe_sort_chunks_by_index",
    "moe_sort_chunks_by_index_with_probs",
    "QuantizedTensor",
    "Float8Tensor",
    "Float8BlockwiseTensor",
    "MXFP8Tensor",
    "PerTensor",
    "Blockwise",
    "RowWise",
    "MXFP8",
    "quantize",
    "dequantize",
    "register_passthrough",
    "unregister_passthrough",
    "passthrough_ops",
    "strict_dispatch",
    "QuantizedFallbackWarning",
    "QuantizedDispatchError",
]

"""MoE permutation as ``torch.library`` custom ops (``qmoe::...``), call-compatible with
TransformerEngine's ``moe_permute`` family. Triton kernels on CUDA, compiled C++ kernels on
CPU (``csrc/``; vectorized torch when built without them), and a pure-torch reference in
``qmoe.ops.reference``."""

from qmoe.ops.unpermute import moe_unpermute  # noqa: I001  (defines qmoe::unpermute first)
from qmoe.ops.permute import moe_permute, moe_permute_and_pad_with_probs, moe_permute_with_probs
from qmoe.ops.sort_chunks import moe_sort_chunks_by_index, moe_sort_chunks_by_index_with_probs
from qmoe.ops import fp8 as _fp8  # noqa: F401  (passthrough rules for quantized inputs)

__all__ = [
    "moe_permute",
    "moe_permute_with_probs",
    "moe_permute_and_pad_with_probs",
    "moe_unpermute",
    "moe_sort_chunks_by_index",
    "moe_sort_chunks_by_index_with_probs",
]

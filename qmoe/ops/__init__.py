"""MoE permutation as ``torch.library`` custom ops (``qmoe::...``), call-compatible with
TransformerEngine's ``moe_permute`` family. Triton kernels on CUDA, compiled C++ kernels on
CPU (``csrc/``; vectorized torch when built without them), and a pure-torch reference in
``qmoe.ops.reference``.

Each op module defines its own ``qmoe::`` ops and imports the modules whose ops it uses,
so no import order matters; ``fp8`` registers the quantized types' passthrough rules on
them (imported here, so ``import qmoe.ops`` makes FP8 inputs work)."""

from qmoe.ops import fp8
from qmoe.ops.counts import expert_offsets, tokens_per_expert
from qmoe.ops.grouped_mm import ExpertWeightsFP8, grouped_mm, quantize_expert_weights
from qmoe.ops.permute import moe_permute, moe_permute_and_pad_with_probs, moe_permute_with_probs
from qmoe.ops.sort_chunks import moe_sort_chunks_by_index, moe_sort_chunks_by_index_with_probs
from qmoe.ops.swiglu import swiglu
from qmoe.ops.unpermute import moe_unpermute

__all__ = [
    "fp8",
    "tokens_per_expert",
    "expert_offsets",
    "grouped_mm",
    "quantize_expert_weights",
    "ExpertWeightsFP8",
    "moe_permute",
    "moe_permute_with_probs",
    "moe_permute_and_pad_with_probs",
    "moe_unpermute",
    "moe_sort_chunks_by_index",
    "moe_sort_chunks_by_index_with_probs",
    "swiglu",
]

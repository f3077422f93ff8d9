"""The quantize kernel's launch tiling, in one place (``quantize_rows_triton``; the fused
quantize-permute's per-tensor block too). qmoe.ops' tilings and thresholds are in
``qmoe.ops.tuning``; this module is separate because qmoe.tensors does not import qmoe.ops.
Each constant has one comment line saying what it is; results never depend on these.
"""

from __future__ import annotations

from qmoe._intmath import next_pow2

#: Column block of per-tensor quantizing (one given scale: the block is only the tile width).
PER_TENSOR_BLOCK = 512


def quantize_rows_tile(block_size: int, nb: int) -> tuple[int, int, int]:
    """``(BLOCK_R, GROUPS, num_warps)`` of ``quantize_rows_kernel`` over rows of ``nb``
    blocks of ``block_size``: GROUPS blocks a program (up to 512 columns, at most
    ``next_pow2(nb)``) of BLOCK_R rows (about 4096 elements), 4 warps.
    ``python -m benchmarks sweep quantize`` sweeps it (docs/benchmarks.md, "Quantize
    (`bench quantize`)")."""
    groups = max(1, min(512 // block_size, next_pow2(nb)))
    return max(1, 4096 // (groups * block_size)), groups, 4


def dequantize_rows_tile(h: int) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_H, num_warps)`` of ``dequantize_rows_kernel``: tiles of up to 1024
    columns and about 4096 elements, 4 warps."""
    bh = max(16, min(1024, next_pow2(h)))
    return max(1, 4096 // bh), bh, 4

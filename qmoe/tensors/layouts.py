"""What names an FP8 layout, defined once: the dtypes, the scale modes (names and the
kernels' numbers), the scale layouts of quantized rows, the fp8 formats' bit fields and
the block-size rule of each API. Plain Python and torch dtypes (no Triton), so every layer
imports them from here: ``qmoe.tensors``, ``qmoe.ops`` and ``qmoe.interop``.
"""

from __future__ import annotations

from types import MappingProxyType

import torch

#: The fp8 dtypes of qmoe's tensors and recipes.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: The high-precision dtypes: what ``quantize`` takes, a quantized tensor's ``orig_dtype``,
#: the rows the ops move unquantized (``qmoe.ops.checks.FLOATS``).
HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Scale modes: the SCALE_MODE constexpr of the quantize kernels (``quantize_tile`` in
# qmoe/tensors/kernels/quantize.py compares against these names as ``tl.constexpr``) and
# of the C++ kernels (csrc/, the same numbers).
SCALE_AMAX = 0  # scale = max(amax, EPS) / FP8_MAX, fp32
SCALE_POW2 = 1  # the same, rounded up to a power of two, fp32
SCALE_MX_FLOOR = 2  # OCP MX v1.0: 2 ** (floor(log2(amax)) - EMAX_ELEM), e8m0 byte
SCALE_GIVEN = 3  # per-tensor: one fp32 scale read from s_ptr, nothing written
SCALE_MX_RCEIL = 4  # TransformerEngine: amax / FP8_MAX rounded up to a power of two, e8m0
#: Block ``scale_mode`` name -> its SCALE_MODE (read-only: no module-level mutable state).
#: The per-tensor "given" scale is ``SCALE_GIVEN`` and takes no mode name here.
SCALE_MODES = MappingProxyType({"amax": SCALE_AMAX, "pow2": SCALE_POW2,
                                "mx_floor": SCALE_MX_FLOOR, "mx_rceil": SCALE_MX_RCEIL})
#: The modes whose scales are e8m0 bytes (``uint8``).
E8M0_MODES = frozenset({"mx_floor", "mx_rceil"})
#: Smallest amax a block scale is computed from, so all-zero blocks get a finite scale.
EPS = 1e-12


def scale_dtype(scale_mode: str) -> torch.dtype:
    """The dtype of a block mode's scales: e8m0 bytes as ``uint8`` for MX, else fp32."""
    return torch.uint8 if scale_mode in E8M0_MODES else torch.float32

# Scale layouts of quantized rows: ``qmoe::unpermute_fp8``'s ``layout`` (its Triton
# kernel's LAYOUT, which compares against these names, and the C++ kernel's).
FP8_PER_TENSOR = 0  # one fp32 scale for all rows (Float8Tensor)
FP8_BLOCK_FP32 = 1  # fp32 block scales, a row of them per data row (Float8BlockwiseTensor)
FP8_BLOCK_E8M0 = 2  # e8m0 block scale bytes, a row of them per data row (MXFP8Tensor)

#: The MX block (OCP MX v1.0): one e8m0 scale per 1 x 32 elements (MXFP8, MXFP8Tensor).
MX_BLOCK_SIZE = 32
#: The default ``block_size`` of ``qmoe.Blockwise`` and ``Float8BlockwiseTensor``:
#: DeepSeek-V3's 1 x 128 activation blocks.
BLOCKWISE_BLOCK_SIZE = 128
#: ``qmoe.Blockwise``'s ``block_size``: a power of two in this range (inclusive).
BLOCKWISE_BLOCK_SIZES = (16, 1024)
#: The direct quantize ops' ``block_size`` (``qmoe::quantize_blocks``, the fused
#: ``qmoe::quantize_permute*``; the C++ kernel checks the same): a power of two in this range.
OP_BLOCK_SIZES = (1, 16384)


def check_block_size(name: str, block_size) -> None:
    """A quantized tensor's ``block_size`` (``Float8BlockwiseTensor``, and every loaded
    tensor's): a positive int, not only a power of two (a torchao per-row scale gives H)."""
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ValueError(f"{name}: block_size must be a positive int, got {block_size!r}")


def emax_elem(fp8_dtype: torch.dtype) -> int:
    """The exponent of ``fp8_dtype``'s largest power of two (OCP MX's ``emax_elem``): 8
    for e4m3fn, 15 for e5m2."""
    return 8 if fp8_dtype == torch.float8_e4m3fn else 15


def fp8_fields(fp8_dtype: torch.dtype) -> tuple[int, int]:
    """``(MB, BIAS)`` of ``fp8_dtype`` as the kernels' bit conversions take them: mantissa
    bits and exponent bias, 3 and 7 for e4m3fn, 2 and 15 for e5m2."""
    return (3, 7) if fp8_dtype == torch.float8_e4m3fn else (2, 15)

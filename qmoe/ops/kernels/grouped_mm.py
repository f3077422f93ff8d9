"""Triton code of ``qmoe.grouped_mm``'s helpers, with their launchers at the end: the
expert weights quantized per output column and written transposed
(``quantize_cols_kernel``, the CUDA kernel of ``qmoe::quantize_cols``), the rows past the
last group zeroed in place (``zero_tail_kernel``, of ``qmoe::zero_tail_``), and the
offsets checked in one launch (``check_offsets_kernel``: a device assert, for eager CUDA
calls, where the same check in torch ops is seven launches).

Glossary: E experts, K the contraction dim, M the output width, N rows, BLOCK_K x BLOCK_M
a tile of one expert's ``[K, M]`` matrix.

``torch._scaled_grouped_mm`` takes the weights ``[E, K, M]`` column-major, one scale per
expert and output column: bits ``[E, M, K]`` contiguous, each column quantized along K.
One program owns BLOCK_M columns of one expert and reads them twice: a first pass over K
reduces each column's amax (loads coalesced along M), a second scales the same tiles and
stores them transposed (coalesced along K). 5 bytes of traffic an element (bf16 read
twice, e4m3 written once), where a transposing copy and then a row quantize move 7.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qmoe._intmath import cdiv
from qmoe._triton import launch
from qmoe.ops.launch import assert_options
from qmoe.ops.tuning import check_offsets_tile, quantize_cols_tile, zero_tail_tile
from qmoe.tensors.kernels.quantize import fp32_to_fp8_bits, to_fp32
from qmoe.tensors.layouts import EPS, fp8_fields
from qmoe.tensors.recipes import fp8_max


@triton.jit
def quantize_cols_kernel(
    w_ptr,  # (E, K, M) fp32 / bf16 / fp16, contiguous: the expert weights
    q_ptr,  # (E, M, K) uint8 view of the fp8 bits, contiguous: w[e] transposed, quantized
    s_ptr,  # (E, M) fp32: one scale per expert and column
    K,
    M,
    FP8_MAX: tl.constexpr,
    EPS: tl.constexpr,
    MB: tl.constexpr,  # fp8 mantissa bits: 3 e4m3fn, 2 e5m2
    BIAS: tl.constexpr,  # fp8 exponent bias: 7 e4m3fn, 15 e5m2
    HW_CAST: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Columns ``[pid_m * BLOCK_M, +BLOCK_M)`` of expert ``pid_e``: ``scale = max(amax,
    EPS) / FP8_MAX`` over K (NaN where a column holds NaN), the bits ``w / scale``
    saturated, RNE: the rule of ``quantize_rows_kernel``'s ``"amax"`` mode, so the bits
    equal a row quantize of the transposed weights."""
    pid_m = tl.program_id(0)
    e = tl.program_id(1).to(tl.int64)
    cols = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    cmask = cols < M
    base = e * K * M  # the same offset in w and q: both hold K * M elements an expert
    amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
    has_nan = tl.zeros((BLOCK_M,), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
        mask = (ks < K)[:, None] & cmask[None, :]
        x = to_fp32(tl.load(w_ptr + base + ks[:, None].to(tl.int64) * M + cols[None, :],
                            mask=mask, other=0.0), HW_CAST)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
        has_nan = tl.maximum(has_nan, tl.max((x != x).to(tl.int32), axis=0))
    nan = tl.full((BLOCK_M,), 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    scale = tl.math.div_rn(tl.where(amax < EPS, EPS, amax), FP8_MAX)
    scale = tl.where(has_nan > 0, nan, scale)
    tl.store(s_ptr + e * M + cols, scale, mask=cmask)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask = (ks < K)[:, None] & cmask[None, :]
        x = to_fp32(tl.load(w_ptr + base + ks[:, None].to(tl.int64) * M + cols[None, :],
                            mask=mask, other=0.0), HW_CAST)
        y = tl.math.div_rn(x, scale[None, :])
        y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX))
        q = fp32_to_fp8_bits(y, MB, BIAS, HW_CAST)  # (BLOCK_K, BLOCK_M)
        tl.store(q_ptr + base + cols[None, :].to(tl.int64) * K + ks[:, None], q, mask=mask)


@triton.jit
def zero_tail_kernel(
    out_ptr,  # (N, W), row stride stride_o: zeroed in place from row offs_ptr[E - 1]
    offs_ptr,  # (E,) int32: each group's end row; E >= 1
    N,
    W,
    E,
    stride_o,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Zero rows ``[offs[E - 1], N)`` of ``out``: rows no group owns. A program whose
    BLOCK_R rows all lie below the end costs one scalar load."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    end = tl.load(offs_ptr + E - 1)
    todo = (rows >= end) & (rows < N)
    if tl.max(todo.to(tl.int32), axis=0) > 0:
        zero = tl.zeros((BLOCK_R, BLOCK_W), dtype=out_ptr.dtype.element_ty)
        for w0 in range(0, W, BLOCK_W):
            cols = w0 + tl.arange(0, BLOCK_W)
            tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :], zero,
                     mask=todo[:, None] & (cols < W)[None, :])


@triton.jit
def check_offsets_kernel(
    offs_ptr,  # (E,) int32: each group's end row
    E,
    N,  # the rows' count
    BLOCK_E: tl.constexpr,  # >= E, a power of 2
):
    """One program: ``0 <= offs[0] <= offs[1] <= ... <= offs[E - 1] <= N``, else a device
    assert (compiled in by ``assert_options``)."""
    i = tl.arange(0, BLOCK_E)
    cur = tl.load(offs_ptr + i, mask=i < E, other=0)
    prev = tl.load(offs_ptr + i - 1, mask=(i >= 1) & (i < E), other=0)
    ok = (i >= E) | ((cur >= prev) & (cur <= N))
    tl.device_assert(ok, "qmoe grouped_mm: offsets must rise from >= 0 to at most N (the "
                     "rows' count); pass qmoe.expert_offsets of the permute's counts")


# ------------------------------------------------------------------------- launchers


def quantize_cols_triton(
    w: torch.Tensor,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    tiling: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bits [E, M, K] fp8, scale [E, M] fp32)`` of ``w [E, K, M]`` (fp32 / bf16 / fp16)
    quantized per expert and column along K, in one launch (CUDA, or CPU under
    ``TRITON_INTERPRET=1``). ``out``: preallocated outputs (tests: poisoned). ``tiling``:
    ``(BLOCK_K, BLOCK_M, num_warps)`` overriding ``quantize_cols_tile``. No host sync."""
    e, k, m = w.shape
    if out is None:
        q = torch.empty((e, m, k), dtype=fp8_dtype, device=w.device)
        s = torch.empty((e, m), dtype=torch.float32, device=w.device)
    else:
        q, s = out
    if w.numel() == 0:
        if e * m:
            s.fill_(EPS / fp8_max(fp8_dtype))  # a column of no elements: amax 0
        return q, s
    w = w.contiguous()
    bk, bm, nw = quantize_cols_tile(k, m) if tiling is None else tiling
    mb, bias = fp8_fields(fp8_dtype)
    launch(quantize_cols_kernel, (cdiv(m, bm), e),
        w, q.view(torch.uint8), s, k, m,
        FP8_MAX=fp8_max(fp8_dtype), EPS=EPS, MB=mb, BIAS=bias, HW_CAST=w.is_cuda,
        BLOCK_K=bk, BLOCK_M=bm, num_warps=nw,
    )
    return q, s


def zero_tail_triton(out: torch.Tensor, offsets: torch.Tensor) -> None:
    """Zero the rows of ``out [N, W]`` (unit column stride) at or past ``offsets[-1]``
    (int32 ``[E]``, E >= 1), in place, one launch. No host sync."""
    n, w = out.shape
    if n == 0 or w == 0:
        return
    br, bw, nw = zero_tail_tile(w)
    launch(zero_tail_kernel, (cdiv(n, br),),
        out, offsets, n, w, offsets.shape[0], out.stride(0),
        BLOCK_R=br, BLOCK_W=bw, num_warps=nw,
    )


def check_offsets_triton(offsets: torch.Tensor, n: int) -> None:
    """Device-assert that int32 ``offsets [E]`` rise from >= 0 to at most ``n``: one launch,
    no host sync (a failure surfaces at the next synchronizing call, as CUDA asserts do)."""
    e = offsets.shape[0]
    if e == 0:
        return
    be, nw = check_offsets_tile(e)
    launch(check_offsets_kernel, (1,), offsets.contiguous(), e, n, BLOCK_E=be, num_warps=nw,
           **assert_options())

"""Triton code of the experts' SwiGLU (``qmoe::swiglu``, ``qmoe::swiglu_quantize``,
``qmoe::swiglu_backward``), with its launchers at the end.

Glossary: N rows, F the activation width, ``h [N, 2F]`` the gate-up GEMM's output
(``a = h[:, :F]`` the gate, ``b = h[:, F:]`` the up projection), BS the scale block along
F, NB = ceil(F / BS) blocks a row.

``act = silu(a) * b`` in fp32, rounded once to h's dtype. The quantizing form then
quantizes that rounded row with ``quantize_tile`` (the quantize kernel's code), so its bits
are those of ``qmoe.quantize(swiglu(h), recipe)``: one pass over h instead of the
activation written, read back and quantized. The backward reads ``grad [N, F]`` and h and
writes ``grad_h [N, 2F]`` in one pass:
``grad_a = grad * b * s * (1 + a * (1 - s))`` and ``grad_b = grad * a * s``, ``s =
sigmoid(a)``, in fp32 (``tl.exp`` is the GPU's approximate exponential: the fp32 math
agrees with torch's to a few units in the last place, so the CUDA and CPU paths of these
ops may differ by one rounding of the output). bf16 is rounded through its bits where
there is no hardware cast (the interpreter), as the GPU rounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qmoe._intmath import cdiv
from qmoe._triton import launch
from qmoe.ops.launch import unit_stride
from qmoe.ops.tuning import swiglu_backward_tile, swiglu_tile
from qmoe.tensors.kernels.quantize import quantize_tile, round_to, to_fp32
from qmoe.tensors.layouts import EPS, SCALE_MODES, emax_elem, fp8_fields, scale_dtype
from qmoe.tensors.recipes import fp8_max


@triton.jit
def _silu_parts(a):
    """``(silu(a), sigmoid(a))`` in fp32."""
    s = tl.math.div_rn(1.0, 1.0 + tl.exp(-a))
    return a * s, s


@triton.jit
def swiglu_kernel(
    h_ptr,  # (N, 2F) bf16 / fp32, row stride stride_h, unit column stride
    out_ptr,  # (N, F) h's dtype, contiguous: the activation (unless QUANT)
    q_ptr,  # (N, F) uint8 view of the fp8 bits, contiguous (QUANT)
    s_ptr,  # (N, NB) fp32 or uint8 (e8m0) block scales (QUANT)
    N,
    F,
    NB,
    stride_h,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    EMAX_ELEM: tl.constexpr,
    EPS: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    MB: tl.constexpr,
    BIAS: tl.constexpr,
    HW_CAST: tl.constexpr,
    BS: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """A ``[BLOCK_R, GROUPS * BS]`` tile of the activation (of whole scale blocks when
    QUANT)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    blocks = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = blocks[:, None] * BS + tl.arange(0, BS)[None, :]  # (GROUPS, BS)
    rmask = rows < N
    mask = rmask[:, None, None] & (cols < F)[None, :, :]
    rows64 = rows.to(tl.int64)
    hp = h_ptr + rows64[:, None, None] * stride_h + cols[None, :, :]
    a = to_fp32(tl.load(hp, mask=mask, other=0.0), HW_CAST)
    b = to_fp32(tl.load(hp + F, mask=mask, other=0.0), HW_CAST)
    act = round_to(_silu_parts(a)[0] * b, h_ptr, HW_CAST)  # h's dtype
    offs = rows64[:, None, None] * F + cols[None, :, :]
    if QUANT:
        q, stored = quantize_tile(act, s_ptr, FP8_MAX, EMAX_ELEM, EPS, SCALE_MODE, MB, BIAS,
                                  HW_CAST)
        smask = rmask[:, None] & (blocks < NB)[None, :]
        tl.store(s_ptr + rows64[:, None] * NB + blocks[None, :], stored, mask=smask)
        tl.store(q_ptr + offs, q, mask=mask)
    else:
        tl.store(out_ptr + offs, act, mask=mask)


@triton.jit
def swiglu_backward_kernel(
    g_ptr,  # (N, F) bf16 / fp32, row stride stride_g, unit column stride: the gradient
    h_ptr,  # (N, 2F) h's dtype, row stride stride_h, unit column stride
    gh_ptr,  # (N, 2F) h's dtype, contiguous: the gradient of h
    N,
    F,
    stride_g,
    stride_h,
    HW_CAST: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < N)[:, None] & (cols < F)[None, :]
    rows64 = rows.to(tl.int64)
    g = to_fp32(tl.load(g_ptr + rows64[:, None] * stride_g + cols[None, :], mask=mask,
                        other=0.0), HW_CAST)
    hp = h_ptr + rows64[:, None] * stride_h + cols[None, :]
    a = to_fp32(tl.load(hp, mask=mask, other=0.0), HW_CAST)
    b = to_fp32(tl.load(hp + F, mask=mask, other=0.0), HW_CAST)
    silu, s = _silu_parts(a)
    ga = g * b * s * (1.0 + a * (1.0 - s))
    gb = g * silu
    op = gh_ptr + rows64[:, None] * (2 * F) + cols[None, :]
    tl.store(op, round_to(ga, gh_ptr, HW_CAST), mask=mask)
    tl.store(op + F, round_to(gb, gh_ptr, HW_CAST), mask=mask)


# ------------------------------------------------------------------------- launchers


def swiglu_triton(
    h: torch.Tensor,
    quantize: tuple[int, torch.dtype, str] | None = None,
    *,
    out: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``silu(h[:, :F]) * h[:, F:]`` of ``h [N, 2F]`` (bf16 / fp32) in one launch (CUDA,
    or CPU under ``TRITON_INTERPRET=1``): ``[N, F]`` in h's dtype, or with ``quantize =
    (block_size, fp8_dtype, scale_mode)`` (``qmoe::quantize_blocks``' arguments) the
    ``(bits [N, F] fp8, scales [N, NB])`` of that activation. ``out``: preallocated
    outputs (tests: poisoned). No host sync."""
    n, f = h.shape[0], h.shape[1] // 2
    h = unit_stride(h)
    if quantize is None:
        o = torch.empty((n, f), dtype=h.dtype, device=h.device) if out is None else out
        bs, nb, mode, fp8 = None, 1, 0, torch.float8_e4m3fn
    else:
        bs, fp8, scale_mode = quantize
        nb = cdiv(f, bs)
        mode = SCALE_MODES[scale_mode]
        o = (torch.empty((n, f), dtype=fp8, device=h.device),
             torch.empty((n, nb), dtype=scale_dtype(scale_mode), device=h.device)
             ) if out is None else out
    if n == 0 or f == 0:
        return o
    block_r, groups, bs, nw = swiglu_tile(f, bs)
    mb, bias = fp8_fields(fp8)
    quant = quantize is not None
    launch(swiglu_kernel, (cdiv(n, block_r), cdiv(cdiv(f, bs), groups)),
        h, None if quant else o, o[0].view(torch.uint8) if quant else None,
        o[1] if quant else None, n, f, nb, h.stride(0),
        QUANT=quant, FP8_MAX=fp8_max(fp8), EMAX_ELEM=emax_elem(fp8), EPS=EPS,
        SCALE_MODE=mode, MB=mb, BIAS=bias, HW_CAST=h.is_cuda, BS=bs,
        GROUPS=groups, BLOCK_R=block_r, num_warps=nw,
    )
    return o


def swiglu_backward_triton(grad: torch.Tensor, h: torch.Tensor, *,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """``grad_h [N, 2F]`` (h's dtype) of the SwiGLU of ``h [N, 2F]`` given ``grad [N, F]``,
    in one launch. ``out``: preallocated (tests: poisoned). No host sync."""
    n, f = grad.shape
    gh = torch.empty((n, 2 * f), dtype=h.dtype, device=h.device) if out is None else out
    if n == 0 or f == 0:
        return gh
    grad, h = unit_stride(grad), unit_stride(h)
    br, bf, nw = swiglu_backward_tile(f)
    launch(swiglu_backward_kernel, (cdiv(n, br), cdiv(f, bf)),
        grad, h, gh, n, f, grad.stride(0), h.stride(0),
        HW_CAST=h.is_cuda, BLOCK_R=br, BLOCK_F=bf,
        num_warps=nw,
    )
    return gh

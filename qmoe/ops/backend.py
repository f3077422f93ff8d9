"""Row movement primitives behind the custom ops: Triton on CUDA, vectorized torch on CPU.

Glossary: T tokens, H hidden, S map slots per token, N output rows, P probs columns.
Each primitive takes ``use_triton`` (default: ``x.is_cuda``); tests pass ``True`` on CPU
under ``TRITON_INTERPRET=1`` to run the real kernels. The Triton paths never sync with
the host; the torch paths (``use_triton=False``) read values on the host and serve CPU
tensors only. No primitive keeps state between calls: every temporary comes from the
caching allocator on the input's device.
"""

from __future__ import annotations

import torch

from qmoe._intmath import cdiv, next_pow2
from qmoe.ops.row_id_map import num_slots, unit_stride
from qmoe.ops.tuning import (
    fp8_merge_tile,
    gather_tile,
    merge_tile,
    scatter_tile,
    tail_programs,
    zero_rows_tile,
)
from qmoe.tensors.base import e8m0_to_fp32, expand_block_scales
from qmoe.tensors.layouts import FP8_BLOCK_E8M0, FP8_PER_TENSOR, fp8_fields


def assert_options() -> dict[str, bool]:
    """Launch options of the kernels that check their inputs with ``tl.device_assert``
    (``check_routes``, ``assert_probs_not_nan``, the chunk sort's checks): ``debug=True`` compiles
    the asserts in, ``sanitize_overflow=False`` keeps out the integer-overflow checks that
    debug would add, so the asserts are the only difference; Inductor launches its own
    kernels the same way. A new dict each call."""
    return {"debug": True, "sanitize_overflow": False}


def _routes(rid: torch.Tensor, *probs: torch.Tensor | None, rows: int | None = None):
    """(token, row, probs column) of every kept route, token-major then row order: the
    first ``count`` entries of each map row (its last column). Checked as the C++ path
    checks them (ValueErrors: the map is the caller's to pass back): each count in
    ``[0, S]``, each kept row in ``[0, rows)`` when ``rows`` is given, each column inside
    the width of each of ``probs`` given (a negative one would wrap)."""
    s = num_slots(rid)
    t = rid.shape[0]
    count = rid[:, 2 * s]
    if t and bool(((count < 0) | (count > s)).any()):
        raise ValueError(f"qmoe: row_id_map counts routes outside [0, {s}] (its slots); pass "
                         "the row_id_map qmoe built")
    valid = torch.arange(s, device=rid.device)[None, :] < count[:, None]
    dst = rid[:, :s][valid].long()
    if rows is not None and dst.numel():
        lo, hi = (int(v) for v in torch.aminmax(dst))
        if lo < 0 or hi >= rows:
            raise ValueError(f"qmoe: row_id_map names rows outside [0, {rows}) (the permuted "
                             "rows); pass the row_id_map built for these rows")
    tok = torch.arange(t, device=rid.device)[:, None].expand(-1, s)
    col = rid[:, s : 2 * s][valid].long()
    widths = [p.shape[1] for p in probs if p is not None]
    if widths and col.numel():
        lo, hi = (int(v) for v in torch.aminmax(col))
        if lo < 0 or hi >= min(widths):
            raise ValueError(f"qmoe: row_id_map names probs columns outside [0, {min(widths)}); "
                             "pass the row_id_map qmoe built with these probs' routing")
    return tok[valid], dst, col


def permute_rows(
    x: torch.Tensor,
    rid: torch.Tensor,
    n: int,
    weights: torch.Tensor | None = None,
    *,
    probs: torch.Tensor | None = None,
    probs_out: torch.Tensor | None = None,
    side: torch.Tensor | None = None,
    side_out: torch.Tensor | None = None,
    fill: torch.Tensor | None = None,
    use_triton: bool | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out [N, H]``: each token's row (times ``weights[t, col]`` if given) at its rows;
    rows no route writes are zero. ``x`` ``[T, H]``, ``weights`` ``[T, P]`` float.
    With ``probs`` ``[T, P]``, also fills ``probs_out`` ``[N]`` (probs' dtype) with each
    route's ``probs[t, col]`` at its row, zero elsewhere, in the same pass; with ``side``
    ``[T, NS]`` (block scales of quantized rows), fills ``side_out`` ``[N, NS]`` alike.
    ``fill`` (``[R, 2]`` int32 from ``make_row_id_map``: the rows no route writes) lets
    the kernel zero those rows in the same launch; without it the rows written are
    flagged and a second pass zeroes the rest."""
    t, h = x.shape
    use_triton = x.is_cuda if use_triton is None else use_triton
    if not use_triton:
        out = torch.zeros(n, h, dtype=x.dtype, device=x.device)
        tok, row, col = _routes(rid, weights, probs, rows=n)
        val = x[tok]
        if weights is not None:
            val = (val.float() * weights[tok, col].float()[:, None]).to(x.dtype)
        out[row] = val
        if probs is not None:
            probs_out.zero_()[row] = probs[tok, col]
        if side is not None:
            side_out.zero_()[row] = side[tok]
        return out
    from qmoe.ops._kernels.permute import permute_scatter_kernel

    if out is None:  # (tests pass a poisoned ``out`` to see every row gets written)
        out = torch.empty(n, h, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    x, weights, probs = unit_stride(x), unit_stride(weights), unit_stride(probs)
    rid = rid.contiguous()  # rows of 2S+1 entries
    fill = fill.contiguous() if fill is not None else None
    bh, nw, kb = scatter_tile(h, x.element_size(), weights is not None)
    has_f = fill is not None
    # Arguments a launch does not use go in as None (Triton makes them compile-time
    # constants): each tensor argument costs about 2 us of host time per launch in Triton's
    # binding, which is most of a small eager call (``python -m benchmarks profile small``).
    written = None if has_f else torch.zeros(n, dtype=torch.int8, device=x.device)
    has_p = probs is not None
    has_s = side is not None
    side = unit_stride(side)
    ns = side.shape[1] if has_s else 0
    bs = next_pow2(max(ns, 1))
    progs, r, z = scatter_programs(t, n, fill)
    if progs:
        has_w = weights is not None
        permute_scatter_kernel[(progs, cdiv(max(h, 1), bh))](
            x, out, rid, weights, written, fill, probs, probs_out if has_p else None, side,
            side_out if has_s else None, t, n, h,
            num_slots(rid), ns, r, z, x.stride(0), weights.stride(0) if has_w else None,
            probs.stride(0) if has_p else None, side.stride(0) if has_s else None,
            HAS_W=has_w, HAS_P=has_p, HAS_SIDE=has_s, HAS_FILL=has_f, KB=kb, BLOCK_H=bh,
            BLOCK_S=bs, num_warps=nw, **assert_options(),  # assert_probs_not_nan
        )
    if not has_f:
        zero_unwritten_rows(out, written, probs_out if has_p else None,
                            side_out if has_s else None)
    return out


def zero_unwritten_rows(
    out: torch.Tensor,
    written: torch.Tensor,
    probs_out: torch.Tensor | None = None,
    side_out: torch.Tensor | None = None,
) -> None:
    """Zero the rows of ``out`` ``[N, H]`` (and of ``probs_out`` ``[N]``, ``side_out``
    ``[N, NS]``) whose ``written`` flag (``[N]`` int8) a scatter left 0 (CUDA)."""
    from qmoe.ops._kernels.permute import zero_rows_kernel

    n, h = out.shape
    ns = side_out.shape[1] if side_out is not None else 0
    br, bh, nw = zero_rows_tile(h)
    zero_rows_kernel[(cdiv(n, br),)](
        out, written, probs_out, side_out, n, h, ns, HAS_P=probs_out is not None,
        HAS_SIDE=side_out is not None, BLOCK_R=br, BLOCK_H=bh,
        BLOCK_S=next_pow2(max(ns, 1)), num_warps=nw,
    )


def scatter_programs(t: int, n: int, fill: torch.Tensor | None) -> tuple[int, int, int]:
    """``(programs along axis 0, R, Z)`` of a scatter launch: T token programs, then, with
    ``fill`` (``[R, 2]``), one program per padding range and Z sharing the last range (the
    tail of up to N rows; empty ones cost a load and exit)."""
    if fill is None:
        return t, 0, 0
    r, z = fill.shape[0], tail_programs(n)
    return t + r - 1 + z, r, z


def _merge_routes(vals: torch.Tensor, tok: torch.Tensor, col: torch.Tensor,
                  weights: torch.Tensor | None, t: int, out_dtype: torch.dtype) -> torch.Tensor:
    """The torch merge: each route's fp32 row ``vals [R, H]`` (times ``weights[tok, col]``)
    summed into its token in route order; ``[T, H]`` in ``out_dtype``."""
    if weights is not None:
        vals = vals * weights[tok, col].float()[:, None]
    acc = torch.zeros(t, vals.shape[1], dtype=torch.float32, device=vals.device)
    return acc.index_add_(0, tok, vals).to(out_dtype)


def unpermute_rows(
    x: torch.Tensor,
    rid: torch.Tensor,
    weights: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    use_triton: bool | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out [T, H]``: sum of each token's rows of ``x`` ``[N, H]`` (times ``weights[t,
    col]``), accumulated in fp32 in row order, returned in ``out_dtype`` (default x's)."""
    t = rid.shape[0]
    h = x.shape[1]
    out_dtype = out_dtype or x.dtype
    use_triton = x.is_cuda if use_triton is None else use_triton
    if not use_triton:
        tok, row, col = _routes(rid, weights, rows=x.shape[0])
        return _merge_routes(x[row].float(), tok, col, weights, t, out_dtype)
    from qmoe.ops._kernels.permute import unpermute_gather_kernel

    if out is None:
        out = torch.empty(t, h, dtype=out_dtype, device=x.device)
    if t == 0 or h == 0:
        return out
    x, rid = x.contiguous(), rid.contiguous()
    bh, nw, evict, pairs = merge_tile(h, weights is not None)
    if num_slots(rid) == 0:
        return out.zero_()  # no routes: nothing to read
    w, p = _weights_arg(weights, x)
    unpermute_gather_kernel[(t, cdiv(h, bh))](
        x, out, rid, w, h, num_slots(rid), x.shape[0], w.stride(0), p,
        HAS_W=weights is not None, BLOCK_H=bh, EVICT=evict, PAIRS=pairs, num_warps=nw,
        **assert_options(),  # check_routes
    )
    return out


def _weights_arg(weights: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(w, P)`` for the merge kernels: the weights and their columns. Without weights,
    ``like`` (2D) stands in and is never read; weights of zero columns get a one-column
    stand-in with P = 0, so any route fails the kernel's check and the clamped read stays in
    bounds."""
    if weights is None:
        return like, 1
    if weights.shape[1] == 0:
        return weights.new_zeros((max(weights.shape[0], 1), 1)), 0
    return unit_stride(weights), weights.shape[1]


def merge_weight_grad(grad: torch.Tensor, x: torch.Tensor, rid: torch.Tensor,
                      p: int) -> torch.Tensor:
    """``[T, P]`` fp32: ``<grad[t], x[row]>`` for each kept route, zero elsewhere (torch;
    on CUDA the op takes ``merge_backward_kernel``, which computes it with grad_inp)."""
    gw = torch.zeros(grad.shape[0], p, dtype=torch.float32, device=grad.device)
    tok, row, col = _routes(rid, gw, rows=x.shape[0])
    gw[tok, col] = (grad[tok].float() * x[row].float()).sum(1)
    return gw


def gather_rows(
    x: torch.Tensor,
    src: torch.Tensor,
    *,
    use_triton: bool | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[r] = x[src[r]]`` for ``src`` ``[R]`` int64 (all in range)."""
    use_triton = x.is_cuda if use_triton is None else use_triton
    if not use_triton:
        return x.index_select(0, src)
    from qmoe.ops._kernels.permute import gather_rows_kernel

    r, h = src.shape[0], x.shape[1]
    if out is None:
        out = torch.empty(r, h, dtype=x.dtype, device=x.device)
    if r == 0 or h == 0:
        return out
    x, src = unit_stride(x), src.contiguous()
    br, bh, nw = gather_tile(h, x.element_size())
    gather_rows_kernel[(cdiv(r, br), cdiv(h, bh))](
        x, out, src, r, h, x.stride(0), BLOCK_R=br, BLOCK_H=bh, num_warps=nw
    )
    return out



def dequantize_rows(qbits, scale, layout: int, block_size: int, fp8_dtype) -> torch.Tensor:
    """fp32 ``qdata * scale`` of raw quantized rows (torch), as ``QuantizedTensor`` defines it."""
    v = qbits.view(fp8_dtype).float()
    if layout == FP8_PER_TENSOR:
        return v * scale.float()
    s = e8m0_to_fp32(scale) if layout == FP8_BLOCK_E8M0 else scale.float()
    return v * expand_block_scales(s, qbits.shape[-1], block_size)


def unpermute_fp8_rows(
    qbits: torch.Tensor,
    scale: torch.Tensor,
    layout: int,
    block_size: int,
    fp8_dtype: torch.dtype,
    rid: torch.Tensor,
    weights: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Merge of quantized rows ``qbits [N, H]`` (uint8 fp8 bits) with their scales: each
    row dequantized (fp32) and summed in fp32; ``[T, H]`` in ``out_dtype``."""
    use_triton = qbits.is_cuda if use_triton is None else use_triton
    if not use_triton:  # dequantize the routed rows only (not all N: fp32 is 4x the bits)
        tok, row, col = _routes(rid, weights, rows=qbits.shape[0])
        s = scale if layout == FP8_PER_TENSOR else scale[row]
        vals = dequantize_rows(qbits[row], s, layout, block_size, fp8_dtype)
        return _merge_routes(vals, tok, col, weights, rid.shape[0], out_dtype)
    from qmoe.ops._kernels.permute import unpermute_fp8_kernel

    t, h = rid.shape[0], qbits.shape[1]
    out = torch.empty(t, h, dtype=out_dtype, device=qbits.device)
    if t == 0 or h == 0:
        return out
    bh, nw, evict = fp8_merge_tile(h)
    mb, bias = fp8_fields(fp8_dtype)
    if num_slots(rid) == 0:
        return out.zero_()  # no routes: nothing to read
    w, p = _weights_arg(weights, qbits)
    scale, rid = scale.contiguous(), rid.contiguous()
    # the kernel reads scale row 0 of a bad route
    if layout != FP8_PER_TENSOR and qbits.shape[0] == 0:
        scale = scale.new_zeros((1, scale.shape[-1]))
    unpermute_fp8_kernel[(t, cdiv(h, bh))](
        qbits.contiguous(), scale, out, rid, w, h, num_slots(rid),
        qbits.shape[0], scale.shape[-1] if scale.dim() else 1, w.stride(0), p,
        LAYOUT=layout, BS=max(block_size, 1), MB=mb, BIAS=bias,
        HW_CAST=qbits.is_cuda, HAS_W=weights is not None, BLOCK_H=bh, EVICT=evict,
        num_warps=nw, **assert_options(),  # check_routes
    )
    return out

"""The vectorized-torch kernels of the row movements: the default (CPU) kernels of
``qmoe::permute``, ``qmoe::unpermute``, ``qmoe::unpermute_backward`` and
``qmoe::unpermute_fp8`` where ``qmoe._C`` has no C++ kernel (built with
``QMOE_SKIP_CPP_BUILD=1``). CUDA runs the Triton launchers of ``qmoe.ops.kernels``.

Glossary: T tokens, H hidden, S map slots per token, N permuted rows, P probs columns.
These read values on the host (the map's counts and ranges are checked here, as the C++
kernels check them) and keep no state between calls.
"""

from __future__ import annotations

import torch

from qmoe.ops.launch import num_slots
from qmoe.tensors.base import e8m0_to_fp32, expand_block_scales
from qmoe.tensors.layouts import FP8_BLOCK_E8M0, FP8_PER_TENSOR


def routes(rid: torch.Tensor, *probs: torch.Tensor | None, rows: int | None = None):
    """``(token, row, probs column)`` int64 ``[R]`` of every kept route of the row_id_map
    ``rid [T, 2S+1]``, token-major then row order: the first ``count`` entries of each map
    row (its last column). Checked as the C++ path checks them (ValueErrors: the map is
    the caller's to pass back): each count in ``[0, S]``, each kept row in ``[0, rows)``
    when ``rows`` is given, each column inside the width of each of ``probs`` given (a
    negative one would wrap). Host syncs: the checks."""
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
) -> torch.Tensor:
    """``out [N, H]``: each token's row of ``x [T, H]`` (times ``weights[t, col]``) at its
    rows; rows no route writes are zero. ``probs [T, P]`` into ``probs_out [N]`` and
    ``side [T, NS]`` into ``side_out [N, NS]`` alike (as ``permute_rows_triton``)."""
    out = torch.zeros(n, x.shape[1], dtype=x.dtype, device=x.device)
    tok, row, col = routes(rid, weights, probs, rows=n)
    val = x[tok]
    if weights is not None:
        val = (val.float() * weights[tok, col].float()[:, None]).to(x.dtype)
    out[row] = val
    if probs is not None:
        probs_out.zero_()[row] = probs[tok, col]
    if side is not None:
        side_out.zero_()[row] = side[tok]
    return out


def merge_routes(vals: torch.Tensor, tok: torch.Tensor, col: torch.Tensor,
                 weights: torch.Tensor | None, t: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Each route's fp32 row ``vals [R, H]`` (times ``weights[tok, col]``) summed into its
    token in route order; ``[T, H]`` in ``out_dtype``."""
    if weights is not None:
        vals = vals * weights[tok, col].float()[:, None]
    acc = torch.zeros(t, vals.shape[1], dtype=torch.float32, device=vals.device)
    return acc.index_add_(0, tok, vals).to(out_dtype)


def unpermute_rows(
    x: torch.Tensor,
    rid: torch.Tensor,
    weights: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``[T, H]``: the sum of each token's rows of ``x [N, H]`` (times ``weights[t, col]``),
    accumulated in fp32 in row order, in ``out_dtype`` (default x's)."""
    tok, row, col = routes(rid, weights, rows=x.shape[0])
    return merge_routes(x[row].float(), tok, col, weights, rid.shape[0],
                        out_dtype or x.dtype)


def merge_weight_grad(grad: torch.Tensor, x: torch.Tensor, rid: torch.Tensor,
                      p: int) -> torch.Tensor:
    """``[T, P]`` fp32: ``<grad[t], x[row]>`` for each kept route, zero elsewhere (on CUDA
    ``merge_backward_triton`` computes it with the rows' gradient)."""
    gw = torch.zeros(grad.shape[0], p, dtype=torch.float32, device=grad.device)
    tok, row, col = routes(rid, gw, rows=x.shape[0])
    gw[tok, col] = (grad[tok].float() * x[row].float()).sum(1)
    return gw


def dequantize_rows(qbits, scale, layout: int, block_size: int, fp8_dtype) -> torch.Tensor:
    """fp32 ``qdata * scale`` of raw quantized rows, as ``QuantizedTensor`` defines it."""
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
) -> torch.Tensor:
    """Merge of quantized rows ``qbits [N, H]`` (uint8 fp8 bits) with their scales: the
    routed rows dequantized (fp32; not all N, fp32 is 4x the bits) and summed in fp32;
    ``[T, H]`` in ``out_dtype``."""
    tok, row, col = routes(rid, weights, rows=qbits.shape[0])
    s = scale if layout == FP8_PER_TENSOR else scale[row]
    vals = dequantize_rows(qbits[row], s, layout, block_size, fp8_dtype)
    return merge_routes(vals, tok, col, weights, rid.shape[0], out_dtype)

"""FP8 inputs through the permutation ops: passthrough rules for qmoe's quantized types.

Each rule receives the quantized tensor intact (``QuantizedTensor.__torch_dispatch__``
finds it in the passthrough registry), runs the same ``qmoe::`` op on the raw inner
tensors and rewraps:

* ``qdata`` moves as its ``uint8`` bits (the kernels copy bytes; the Triton interpreter
  has no fp8 pointers), block scales (``[T, ceil(H / block)]`` fp32, or MX e8m0 bits) move
  as rows beside it, a per-tensor scale carries over. Rows no route fills are zero bits,
  which dequantize to exact zeros under every layout (a zero MX scale byte is 2**-127).
* The merge (``qmoe::unpermute``) of a quantized input returns high precision through
  ``qmoe::unpermute_fp8``: each row is dequantized inside the merge kernel (fp8 bits times
  its block scale) and summed in fp32; there is no dequantized copy of the rows.

Because the rules only call ops on plain tensors, AOTAutograd can desugar the subclass
and ``torch.compile(fullgraph=True)`` traces them (docs/design.md).
"""

from __future__ import annotations

import torch

from qmoe._library import define
from qmoe.ops import permute_index as _permute_index  # noqa: F401  (qmoe::permute_index)
from qmoe.ops import permute_mask as _permute_mask  # noqa: F401  (defines qmoe::permute_mask)
from qmoe.ops import sort_chunks as _sort_chunks  # noqa: F401  (defines qmoe::sort_chunks_rows)
from qmoe.ops.backend import permute_rows, unpermute_fp8_rows
from qmoe.tensors.base import QuantizedTensor, register_passthrough
from qmoe.tensors.layouts import FP8_BLOCK_E8M0, FP8_BLOCK_FP32, FP8_PER_TENSOR
from qmoe.tensors.types import MXFP8Tensor

ops = torch.ops.qmoe


def _bits(q: QuantizedTensor) -> torch.Tensor:
    return q.qdata.view(torch.uint8)


def _move_rows(q: QuantizedTensor, run):
    """``run(rows, with_probs) -> (moved rows, permuted probs)`` on the fp8 bits, then on
    the block-scale rows (without probs); rewrap as ``q``'s type."""
    out, pp = run(_bits(q), True)
    scale = q.raw_scale if q.block_size is None else run(q.raw_scale, False)[0]
    return q._rewrap(out.view(q.fp8_dtype), scale), pp


@define(
    "permute_with_scales(Tensor qbits, Tensor scale_rows, Tensor row_id_map, Tensor? probs, "
    "SymInt num_out_tokens, Tensor? fill=None) -> (Tensor, Tensor, Tensor)"
)
def _permute_with_scales(qbits, scale_rows, row_id_map, probs, num_out_tokens, fill=None):
    """``(bits [N, H], scale rows [N, NB], permuted probs [N] or empty)``: quantized rows
    and their block-scale rows moved together (one scatter pass on CUDA)."""
    if qbits.is_cuda:
        n = num_out_tokens
        s_out = scale_rows.new_empty((n, scale_rows.shape[1]))
        pp = probs.new_empty((n,)) if probs is not None else qbits.new_empty(0)
        bits = permute_rows(qbits, row_id_map, n, probs=probs, probs_out=pp, side=scale_rows,
                            side_out=s_out, fill=fill)
        return bits, s_out, pp
    bits, pp = ops.permute(qbits, row_id_map, probs, num_out_tokens)
    s_out = ops.permute(scale_rows, row_id_map, None, num_out_tokens)[0]
    return bits, s_out, pp if probs is not None else qbits.new_empty(0)


@_permute_with_scales.register_fake
def _(qbits, scale_rows, row_id_map, probs, num_out_tokens, fill=None):
    n = num_out_tokens
    pp = probs.new_empty((n,)) if probs is not None else qbits.new_empty(0)
    return (qbits.new_empty((n, qbits.shape[1])),
            scale_rows.new_empty((n, scale_rows.shape[1])), pp)


def permute_args(args, kwargs):
    """``(inp, row_id_map, probs, num_out_tokens, fill)`` of a ``qmoe::permute`` call
    (``fill`` may be left out)."""
    inp, rid, probs, n, *rest = args
    return inp, rid, probs, n, rest[0] if rest else kwargs.get("fill")


@register_passthrough(ops.permute.default)
def _permute_q(func, args, kwargs):
    q, rid, probs, n, fill = permute_args(args, kwargs)
    if q.block_size is not None and q.qdata.dim() == 2:
        bits, scale, pp = ops.permute_with_scales(_bits(q), q.raw_scale, rid, probs, n, fill)
        return q._rewrap(bits.view(q.fp8_dtype), scale), pp
    return _move_rows(
        q, lambda t, with_probs: func(t, rid, probs if with_probs else None, n, fill))


@register_passthrough(ops.permute_index.default)
@register_passthrough(ops.permute_mask.default)
def _permute_mask_q(func, args, kwargs):
    """The fused mask (or index) permute of quantized rows: the fp8 bits move as rows,
    block-scale rows as its side rows (one pass); a per-tensor scale carries over. Both ops
    take ``(inp, routing_map, probs, side, num_out_tokens, <int>)``."""
    q, rmap, probs, side, n, last = args
    if side is not None:
        raise TypeError(f"{func.name()}: side rows come from the quantized inp's scales; "
                        "pass side=None with a quantized inp")
    blocks = q.block_size is not None
    bits, pp, s_out, rid = func(_bits(q), rmap, probs, q.raw_scale if blocks else None, n,
                                last)
    empty = torch.empty(0, dtype=q.dtype, device=q.device)  # no side rows out (as for plain)
    return q._rewrap(bits.view(q.fp8_dtype), s_out if blocks else q.raw_scale), pp, empty, rid


@register_passthrough(ops.sort_chunks.default)
def _sort_chunks_q(func, args, kwargs):
    """The chunk sort of quantized rows: block-scale rows move as side rows of the bits
    (``qmoe::sort_chunks_rows``: one launch on CUDA); a per-tensor scale carries over."""
    q, sizes, index, probs = args
    if q.block_size is None:
        return _move_rows(q, lambda t, with_probs: func(t, sizes, index,
                                                        probs if with_probs else None))
    bits, scale, pp = ops.sort_chunks_rows(_bits(q), q.raw_scale, sizes, index, probs)
    return q._rewrap(bits.view(q.fp8_dtype), scale), pp


@define(
    "unpermute_fp8(Tensor qbits, Tensor scale, Tensor row_id_map, Tensor? merging_probs, "
    "int layout, int block_size, ScalarType fp8_dtype, ScalarType out_dtype) -> Tensor"
)
def _unpermute_fp8(qbits, scale, row_id_map, merging_probs, layout, block_size, fp8_dtype,
                   out_dtype):
    if layout != FP8_PER_TENSOR:  # the kernels index scale rows by block (metadata check)
        nb = -(-qbits.shape[1] // max(block_size, 1))
        if block_size < 1 or scale.dim() != 2 or tuple(scale.shape) != (qbits.shape[0], nb):
            raise ValueError(
                f"qmoe::unpermute_fp8: block scales must be [N, ceil(H / block_size)] = "
                f"[{qbits.shape[0]}, {nb}], got {tuple(scale.shape)} (block_size {block_size})"
            )
    return unpermute_fp8_rows(
        qbits, scale, layout, block_size, fp8_dtype, row_id_map, merging_probs, out_dtype
    )


@_unpermute_fp8.register_fake
def _(qbits, scale, row_id_map, merging_probs, layout, block_size, fp8_dtype, out_dtype):
    return qbits.new_empty((row_id_map.shape[0], qbits.shape[1]), dtype=out_dtype)


def _layout(q: QuantizedTensor) -> int:
    if q.block_size is None:
        return FP8_PER_TENSOR
    return FP8_BLOCK_E8M0 if isinstance(q, MXFP8Tensor) else FP8_BLOCK_FP32


@register_passthrough(ops.unpermute.default)
def _unpermute_q(func, args, kwargs):
    """Merge of quantized rows: dequantized inside the kernel, fp32 sums, orig dtype out."""
    q, rid, weights = args
    return ops.unpermute_fp8(
        _bits(q), q.raw_scale, rid, weights, _layout(q), q.block_size or 0, q.fp8_dtype,
        q.orig_dtype,
    )


@register_passthrough(ops.unpermute_backward.default)
def _unpermute_backward_q(func, args, kwargs):
    grad, rid, weights, fwd_inp, n = args
    if isinstance(fwd_inp, QuantizedTensor):
        fwd_inp = fwd_inp._dequantize_raw(torch.float32)
    if isinstance(grad, QuantizedTensor):
        grad = grad._dequantize_raw()
    return func(grad, rid, weights, fwd_inp, n)

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

The rules are written once, against a small adapter (``RowLayout``: split a tensor into
its fp8 bits and scale, join moved ones back, name its merge layout), with one signature,
``rule(rows, func, args, kwargs)``. ``QMOE_ROWS`` adapts qmoe's types (registered here as
passthrough ops); ``qmoe.interop.torchao`` adapts torchao's and registers the same rules
(``rules``) with ``torch.library.register_torch_dispatch``.

Because the rules only call ops on plain tensors, AOTAutograd can desugar the subclass
and ``torch.compile(fullgraph=True)`` traces them (docs/design.md). They call their inner
``qmoe::`` ops through ``qmoe._library.direct`` (the ``Op``: eager calls skip the
dispatcher's layers), and an eager ``qmoe::`` call on a quantized input that needs no
gradient reaches its rule without the dispatcher (``QuantizedTensor._qmoe_eager_dispatch``).
"""

from __future__ import annotations

import functools

import torch

from qmoe._library import direct
from qmoe.ops.permute import _permute, _permute_with_scales
from qmoe.ops.permute_index import _permute_index
from qmoe.ops.permute_mask import _permute_mask
from qmoe.ops.sort_chunks import _sort_chunks, _sort_chunks_rows
from qmoe.ops.unpermute import (
    _permute_backward_op,
    _unpermute,
    _unpermute_backward,
    _unpermute_fp8,
    probs_grad,
)
from qmoe.tensors.base import QuantizedTensor, register_passthrough
from qmoe.tensors.layouts import FP8_BLOCK_E8M0, FP8_BLOCK_FP32, FP8_PER_TENSOR
from qmoe.tensors.types import MXFP8Tensor


class RowLayout:
    """How the rules see a quantized tensor class (subclass per family of classes)."""

    def split(self, t) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``(bits [..., H] uint8, scale rows [..., NB] to move with them, or None when the
        scale carries over, the scale as stored)``."""
        raise NotImplementedError

    def join(self, t, bits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """A tensor of ``t``'s class around moved ``bits`` (uint8) and ``scale`` (moved
        rows, or the carried scale as ``split`` gave it)."""
        raise NotImplementedError

    def merge_layout(self, t) -> tuple | None:
        """``(layout, block_size, scale, fp8 dtype, out dtype)`` of ``qmoe::unpermute_fp8``
        for ``t``'s rows (the merge dequantizes inside its kernel), or None: the rows are
        dequantized (``dequantized``) and merged in fp32."""
        raise NotImplementedError

    def dequantized(self, t) -> tuple[torch.Tensor, torch.dtype]:
        """``(t`` dequantized in fp32, the dtype the merge returns``)``."""
        raise NotImplementedError


def bits_of(q: QuantizedTensor) -> torch.Tensor:
    """The fp8 data of a qmoe tensor as the kernels move it (``uint8``, same shape)."""
    return q.qdata.view(torch.uint8)


def scale_layout(q: QuantizedTensor) -> int:
    """The ``qmoe.tensors.layouts`` scale layout of a qmoe tensor (``unpermute_fp8``'s)."""
    if q.block_size is None:
        return FP8_PER_TENSOR
    return FP8_BLOCK_E8M0 if isinstance(q, MXFP8Tensor) else FP8_BLOCK_FP32


class _QmoeRows(RowLayout):
    def split(self, t):
        return bits_of(t), (t.raw_scale if t.block_size is not None else None), t.raw_scale

    def join(self, t, bits, scale):
        return t._rewrap(bits.view(t.fp8_dtype), scale)

    def merge_layout(self, t):
        return scale_layout(t), t.block_size or 0, t.raw_scale, t.fp8_dtype, t.orig_dtype

    def dequantized(self, t):
        return t._dequantize_raw(torch.float32), t.orig_dtype


#: The adapter of qmoe's own types (``QuantizedTensor`` subclasses).
QMOE_ROWS = _QmoeRows()


def permute_args(args, kwargs):
    """``(inp, row_id_map, probs, num_out_tokens, fill)`` of a ``qmoe::permute`` call
    (``fill`` may be left out)."""
    inp, rid, probs, n, *rest = args
    return inp, rid, probs, n, rest[0] if rest else kwargs.get("fill")


def permute_rule(rows: RowLayout, func, args, kwargs):
    """``qmoe::permute`` of quantized rows: the bits and their scale rows in one scatter
    (``qmoe::permute_with_scales``); a carried scale stays."""
    x, rid, probs, n, fill = permute_args(args, kwargs)
    bits, srows, scale = rows.split(x)
    func = direct(func)
    if srows is None:
        out, pp = func(bits, rid, probs, n, fill)
        return rows.join(x, out, scale), pp
    if bits.dim() == 2:
        out, s_out, pp = _permute_with_scales(bits, srows, rid, probs, n, fill)
        return rows.join(x, out, s_out), pp
    out, pp = func(bits, rid, probs, n, fill)  # (leading dims: the rows of a 2-D view)
    return rows.join(x, out, func(srows, rid, None, n, fill)[0]), pp


def fused_permute_rule(rows: RowLayout, func, args, kwargs):
    """The fused mask (or index) permute of quantized rows (``qmoe::permute_mask``,
    ``qmoe::permute_index``: ``(inp, routing_map, probs, side, num_out_tokens, <int>)``):
    the bits move as rows, scale rows as their side rows in the same launch; a carried
    scale stays."""
    x, rmap, probs, side, n, last = args
    if side is not None:
        raise TypeError(f"{func.name()}: side rows come from the quantized inp's scales; "
                        "pass side=None with a quantized inp")
    bits, srows, scale = rows.split(x)
    out, pp, s_out, rid = direct(func)(bits, rmap, probs, srows, n, last)
    # no side rows out, as for plain rows (the scale rows travel inside the quantized out)
    return rows.join(x, out, s_out if srows is not None else scale), pp, None, rid


def sort_chunks_rule(rows: RowLayout, func, args, kwargs):
    """The chunk sort of quantized rows: scale rows move as side rows of the bits
    (``qmoe::sort_chunks_rows``: one launch on CUDA); a carried scale stays."""
    x, sizes, index, probs = args
    bits, srows, scale = rows.split(x)
    if srows is None:
        out, pp = direct(func)(bits, sizes, index, probs)
        return rows.join(x, out, scale), pp
    out, s_out, pp = _sort_chunks_rows(bits, srows, sizes, index, probs)
    return rows.join(x, out, s_out), pp


def unpermute_rule(rows: RowLayout, func, args, kwargs):
    """The merge of quantized rows: dequantized inside the kernel (``qmoe::unpermute_fp8``),
    fp32 sums, high precision out; layouts the kernel does not know are dequantized first
    and merged in fp32."""
    x, rid, weights = args
    layout = rows.merge_layout(x)
    if layout is None:
        vals, dtype = rows.dequantized(x)
        return direct(func)(vals, rid, weights).to(dtype)
    bits, _, _ = rows.split(x)
    return _unpermute_fp8(bits, layout[2], rid, weights, layout[0], layout[1], *layout[3:])


def permute_backward_rule(rows: RowLayout, func, args, kwargs):
    """A permute's backward (``qmoe::permute_backward``) with a quantized rows' gradient
    (a compiled graph's guessed FP8 tangent): the rows merged as ``unpermute_rule`` merges
    them, the probs' gradient from the permuted probs' as for plain rows."""
    grad, rid, grad_probs, num_cols, probs_dtype = args
    gi = unpermute_rule(rows, _unpermute, (grad, rid, None), {})
    return gi, probs_grad(rid, grad_probs, rid.shape[0], num_cols, probs_dtype)


def unpermute_backward_rule(rows: RowLayout, func, args, kwargs):
    """The merge's backward with quantized forward rows or gradient: both dequantized (the
    weights' gradient reads the rows in fp32)."""
    grad, rid, weights, fwd_inp, n = args
    if isinstance(fwd_inp, QuantizedTensor):
        fwd_inp = rows.dequantized(fwd_inp)[0]
    if isinstance(grad, QuantizedTensor):
        grad = grad._dequantize_raw()
    return direct(func)(grad, rid, weights, fwd_inp, n)


def rules(rows: RowLayout) -> dict:
    """``{op overload: rule(func, args, kwargs)}`` of the ops that move ``inp``, bound to
    ``rows``: what an adapter registers for its classes."""
    bind = lambda rule: functools.partial(rule, rows)
    return {_permute.default: bind(permute_rule),
            _permute_mask.default: bind(fused_permute_rule),
            _permute_index.default: bind(fused_permute_rule),
            _sort_chunks.default: bind(sort_chunks_rule),
            _unpermute.default: bind(unpermute_rule),
            _permute_backward_op.default: bind(permute_backward_rule)}


for _op, _rule in {**rules(QMOE_ROWS),
                   _unpermute_backward.default: functools.partial(unpermute_backward_rule,
                                                                  QMOE_ROWS)}.items():
    register_passthrough(_op, _rule)

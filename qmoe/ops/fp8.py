"""FP8 inputs through the permutation ops: passthrough rules for qmoe's quantized types.

Each rule receives the quantized tensor intact (``QuantizedTensor.__torch_dispatch__``
finds it in the passthrough registry), runs the same ``qmoe::`` op on the raw inner
tensors and rewraps:

* ``qdata`` moves as its ``uint8`` bits (the kernels copy bytes; the Triton interpreter
  has no fp8 pointers), block scales (``[T, ceil(H / block)]`` fp32, or MX e8m0 bits) move
  as rows beside it, a per-tensor scale carries over. Rows no route fills are zero bits,
  which dequantize to exact zeros under every layout (a zero MX scale byte is 2**-127).
* The merge (``qmoe::unpermute``) of a quantized input returns high precision: the rows
  are dequantized and summed in fp32.

Because the rules only call ops on plain tensors, AOTAutograd can desugar the subclass
and ``torch.compile(fullgraph=True)`` traces them (docs/design.md).
"""

from __future__ import annotations

import torch

from qmoe.tensors.base import QuantizedTensor, register_passthrough

ops = torch.ops.qmoe


def _bits(q: QuantizedTensor) -> torch.Tensor:
    return q.qdata.view(torch.uint8)


@register_passthrough(ops.permute.default)
def _permute_q(func, args, kwargs):
    q, rid, probs, n = args
    out, pp = func(_bits(q), rid, probs, n)
    scale = q.raw_scale if q.block_size is None else func(q.raw_scale, rid, None, n)[0]
    return q._rewrap(out.view(q.fp8_dtype), scale), pp


@register_passthrough(ops.sort_chunks.default)
def _sort_chunks_q(func, args, kwargs):
    q, sizes, index, probs = args
    out, pp = func(_bits(q), sizes, index, probs)
    scale = q.raw_scale if q.block_size is None else func(q.raw_scale, sizes, index, None)[0]
    return q._rewrap(out.view(q.fp8_dtype), scale), pp


@register_passthrough(ops.unpermute.default)
def _unpermute_q(func, args, kwargs):
    q, rid, weights = args
    return func(q._dequantize_raw(torch.float32), rid, weights).to(q.orig_dtype)


@register_passthrough(ops.unpermute_backward.default)
def _unpermute_backward_q(func, args, kwargs):
    grad, rid, weights, fwd_inp, n = args
    if isinstance(fwd_inp, QuantizedTensor):
        fwd_inp = fwd_inp._dequantize_raw(torch.float32)
    if isinstance(grad, QuantizedTensor):
        grad = grad._dequantize_raw()
    return func(grad, rid, weights, fwd_inp, n)

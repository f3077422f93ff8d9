"""``qmoe.grouped_mm``: the expert GEMM of permuted rows, forward and backward, with FP8
rows consumed as they are where this GPU has a grouped FP8 GEMM.

Glossary: N permuted rows, K the contraction dim (the rows' width), M the output width,
E experts (groups). ``offsets`` is what ``qmoe.expert_offsets`` returns: int32 ``[E]``,
the end row of each expert's group (``torch.nn.functional.grouped_mm``'s ``offs``).

Paths, chosen from the inputs, never by a fallback warning:

* **FP8 row-wise** (rows with one scale per row: a ``Float8Tensor``, whose per-tensor
  scale serves every row, or a ``Float8BlockwiseTensor`` whose one block spans the row;
  e4m3; CUDA of compute capability 9.x; K and M multiples of 16, at most 16384):
  ``torch._scaled_grouped_mm`` (through ``qmoe::rowwise_grouped_mm``) on the rows' fp8
  bits and scales as they are, the weights quantized per expert and output column in the
  call (e4m3, ``scale = max(amax, 1e-12) / 448``; one quantize launch after a transposing
  copy). Backward: the input gradient in FP8 (the gradient
  quantized per row, the weights per expert and *input* column), the weight gradient in
  bf16 (2-D x 2-D grouped over the offsets), the rows dequantized for it: on an H100 the
  FP8 form of that shape was measured slower than bf16 (issue tracker, FP8 expert GEMMs).
* **High precision** (everything else): quantized rows dequantized explicitly (blockwise
  1x128 and MX rows have no grouped GEMM of their layout in this torch on Hopper), then
  ``torch.nn.functional.grouped_mm`` in the weights' dtype, forward and backward.

Rows past ``offsets[-1]`` belong to no expert: their output (and their gradient) is zero.

Weights given pre-quantized: ``qmoe.quantize_expert_weights(weight)`` quantizes the
weights once, both ways the FP8 path needs them; ``grouped_mm(..., weight_fp8=wq)`` then
skips the two quantize passes per call (gradient accumulation: quantize once per optimizer
step, reuse across the micro-batches). The weight gradient still goes to ``weight``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from qmoe._intmath import next_pow2
from qmoe._library import define
from qmoe.ops import checks as C
from qmoe.ops.kernels.grouped_mm import (
    check_offsets_triton,
    quantize_cols_triton,
    zero_tail_triton,
)
from qmoe.tensors.base import QuantizedTensor, register_passthrough
from qmoe.tensors.layouts import EPS, OP_BLOCK_SIZES
from qmoe.tensors.quantize import _quantize_blocks
from qmoe.tensors.recipes import Blockwise, PerTensor, RowWise, fp8_max
from qmoe.tensors.types import Float8BlockwiseTensor, Float8Tensor

__all__ = ["grouped_mm", "quantize_expert_weights", "ExpertWeightsFP8", "fp8_gemm_runs"]

_E4M3 = torch.float8_e4m3fn
_FP8_ALIGN = 16  # FP8 GEMM operands: rows of a multiple of 16 bytes (K and M in elements)
_FP8_MAX_WIDTH = OP_BLOCK_SIZES[1]  # widest vector one quantize block spans (K and M)


def _sm90(device: torch.device) -> bool:
    """CUDA of compute capability 9.x: where this torch has the row-wise FP8 grouped GEMM."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def _fp8_widths_ok(k: int | None, m: int | None) -> bool:
    """K and M (when given) multiples of 16 (16-byte FP8 rows) and at most 16384 (the
    weights and gradients are quantized with one block over the vector)."""
    return all(w is None or (w % _FP8_ALIGN == 0 and 0 < w <= _FP8_MAX_WIDTH) for w in (k, m))


def fp8_gemm_runs(recipe, device: torch.device | str, k: int | None = None,
                  m: int | None = None) -> bool:
    """Whether ``grouped_mm`` runs its FP8 GEMM for ``[N, K]`` rows quantized with
    ``recipe`` times ``[E, K, M]`` weights on ``device`` (module doc): one scale per row
    (``PerTensor``, ``RowWise``, or ``Blockwise`` whose block spans K, given K), e4m3,
    CUDA of compute capability 9.x, and (when given) K and M multiples of 16 and at most
    16384. For other recipes quantizing the rows before ``grouped_mm`` saves no GEMM
    time."""
    device = torch.device(device)
    if getattr(recipe, "fp8_dtype", None) != _E4M3 or not _fp8_widths_ok(k, m):
        return False
    if isinstance(recipe, Blockwise):
        if k is None or recipe.block_size < k:
            return False
    elif not isinstance(recipe, (PerTensor, RowWise)):
        return False
    return _sm90(device)


def _rowwise_fp8(rows, m: int) -> bool:
    """Whether ``rows`` take the FP8 row-wise path (module doc)."""
    if not isinstance(rows, (Float8Tensor, Float8BlockwiseTensor)):
        return False
    if rows.fp8_dtype != _E4M3 or not _sm90(rows.device):
        return False
    if not _fp8_widths_ok(rows.shape[-1], m):
        return False
    return rows.block_size is None or rows.block_size >= rows.shape[-1]


def _row_scales(rows) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bits [N, K] e4m3, scale [N] fp32)`` of row-wise FP8 rows."""
    n = rows.shape[0]
    if rows.block_size is None:
        return rows.qdata, rows.scale.float().reshape(1).expand(n).contiguous()
    return rows.qdata, rows.raw_scale.float().reshape(n).contiguous()


def _quantize_last(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 bits, fp32 scales)`` of ``x`` (contiguous) quantized along its last dim (one
    scale per vector, ``max(amax, EPS) / 448``: ``qmoe.RowWise``'s rule), contiguous: one
    ``qmoe::quantize_blocks`` launch with one block over the vector."""
    bs = next_pow2(max(x.shape[-1], 1))
    q, scale = _quantize_blocks(x.contiguous(), bs, _E4M3, "amax")
    return q, scale.squeeze(-1)


def _check_cols_input(w: torch.Tensor) -> None:
    if w.dim() != 3 or w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"qmoe::quantize_cols: w must be [E, K, M] fp32, bf16 or fp16, got "
                        f"{w.dtype} {tuple(w.shape)}")


@define("quantize_cols(Tensor w) -> (Tensor, Tensor)")
def _quantize_cols(w):
    """``(bits [E, M, K] e4m3, scale [E, M] fp32)``: ``w [E, K, M]`` quantized per expert
    and column along K (the rule of ``_quantize_last``) and written transposed, the layout
    ``torch._scaled_grouped_mm`` takes for its second operand. Torch (CPU); one Triton
    launch on CUDA (``quantize_cols_kernel``: 5 bytes of traffic an element, where a
    transposing copy and a row quantize move 7)."""
    _check_cols_input(w)
    e, k, m = w.shape
    if k == 0:  # columns of no elements: amax 0
        return (w.new_empty((e, m, 0), dtype=_E4M3),
                torch.full((e, m), EPS / fp8_max(_E4M3), device=w.device))
    return _quantize_last(w.transpose(-2, -1).contiguous())


@_quantize_cols.register_cuda
def _quantize_cols_cuda(w):
    _check_cols_input(w)
    return quantize_cols_triton(w, _E4M3)


@_quantize_cols.register_fake
def _(w):
    _check_cols_input(w)
    e, k, m = w.shape
    return (w.new_empty((e, m, k), dtype=_E4M3), w.new_empty((e, m), dtype=torch.float32))


@define("zero_tail_(Tensor(a!) out, Tensor offsets) -> ()")
def _zero_tail_(out, offsets):
    """Zero the rows of ``out [N, W]`` at or past ``offsets[-1]`` (int32 ``[E]``, E >= 1)
    in place: rows no group owns. Torch (CPU); one Triton launch on CUDA, whose programs
    below the end return after one load. No host sync."""
    rows = torch.arange(out.shape[0], device=out.device)
    out.masked_fill_((rows >= offsets[-1])[:, None], 0)


@_zero_tail_.register_cuda
def _zero_tail_cuda(out, offsets):
    if out.dim() != 2 or offsets.numel() == 0 or (out.shape[1] > 1 and out.stride(1) != 1):
        return _zero_tail_.fn(out, offsets)  # (grouped_mm passes none of these)
    zero_tail_triton(out, offsets.contiguous())


@_zero_tail_.register_fake
def _(out, offsets):
    return None


class ExpertWeightsFP8(NamedTuple):
    """Expert weights ``[E, K, M]`` quantized for ``grouped_mm``'s FP8 path (e4m3, one
    fp32 scale per vector, ``max(amax, 1e-12) / 448``): what the call would quantize."""

    fwd_bits: torch.Tensor  # [E, M, K] e4m3: per expert and output column, along K
    fwd_scale: torch.Tensor  # [E, M] fp32
    bwd_bits: torch.Tensor | None  # [E, K, M] e4m3: per expert and input column, along M
    bwd_scale: torch.Tensor | None  # [E, K] fp32


@torch.no_grad()
def quantize_expert_weights(weight: torch.Tensor, *, backward: bool = True
                            ) -> ExpertWeightsFP8:
    """Quantize expert weights once for ``grouped_mm(rows, weight, offsets,
    weight_fp8=...)``: the forward's layout (per expert and output column) and, with
    ``backward=True``, the input gradient's (per expert and input column).

    Args:
        weight: ``[E, K, M]`` bf16 CUDA (or CPU: the layouts are made the same way, though
            only Hopper runs the FP8 GEMM), the master weights.
        backward: also quantize the input gradient's layout (skip it for inference).

    Returns ``ExpertWeightsFP8`` (no gradient flows through it: pass the master ``weight``
    beside it). Stale after an optimizer step: quantize again. No host sync.
    """
    fn = "quantize_expert_weights"
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3 or isinstance(
            weight, QuantizedTensor) or not weight.dtype.is_floating_point:
        raise TypeError(f"{fn}: weight must be a plain [E, K, M] float tensor (the master "
                        f"weights), got {type(weight).__name__} "
                        f"{tuple(getattr(weight, 'shape', ()))}")
    if max(weight.shape[1], weight.shape[2]) > _FP8_MAX_WIDTH:
        raise ValueError(f"{fn}: weight is [E, K, M] = {list(weight.shape)}; the FP8 path "
                         f"quantizes vectors of up to {_FP8_MAX_WIDTH} (K and M), so wider "
                         "experts run in bf16 and need no FP8 weights")
    fb, fs = _quantize_cols(weight)
    bb = bs = None
    if backward:
        bb, bs = _quantize_last(weight)
    return ExpertWeightsFP8(fb, fs, bb, bs)


def _high(rows, dtype: torch.dtype) -> torch.Tensor:
    """``rows`` in ``dtype`` (quantized rows dequantized)."""
    if isinstance(rows, QuantizedTensor):
        return rows.dequantize(dtype)
    return rows.to(dtype)


def _zero_tail(out: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``out [N, X]`` (made by this module's GEMM, not yet seen by the caller) with the
    rows at or past ``offsets[-1]`` zeroed in place (no host sync)."""
    if offsets.numel() == 0:
        return out.zero_()
    _zero_tail_(out, offsets)
    return out


@define("rowwise_grouped_mm(Tensor rows, Tensor b_t, Tensor b_scale, Tensor offsets) -> Tensor")
def _rowwise_grouped_mm(rows, b_t, b_scale, offsets):
    """``[N, M]`` bf16: ``torch._scaled_grouped_mm`` of row-wise FP8 ``rows [N, K]`` and
    e4m3 weights ``b_t [E, M, K]`` with fp32 ``b_scale [E, M]``. Quantized rows reach the
    passthrough rule below intact (so a quantized tensor made inside a compiled region needs
    no attribute access by Dynamo); plain rows are quantized per row here first. Rows at
    or past ``offsets[-1]`` are left unwritten (``grouped_mm`` zeroes them)."""
    a, a_scale = _quantize_last(rows)
    return torch._scaled_grouped_mm(a, b_t.transpose(-2, -1), a_scale, b_scale, offsets,
                                    out_dtype=torch.bfloat16)


@_rowwise_grouped_mm.register_fake
def _(rows, b_t, b_scale, offsets):
    return rows.new_empty((rows.shape[0], b_t.shape[1]), dtype=torch.bfloat16)


@register_passthrough(torch.ops.qmoe.rowwise_grouped_mm.default)
def _rowwise_grouped_mm_quantized(func, args, kwargs):
    rows, b_t, b_scale, offsets = args
    a, a_scale = _row_scales(rows)
    return torch._scaled_grouped_mm(a, b_t.transpose(-2, -1), a_scale, b_scale, offsets,
                                    out_dtype=torch.bfloat16)


def _fp8_forward(rows, weight, offsets, wq) -> torch.Tensor:
    # weights [E, K, M] per expert and output column: quantized along K, column-major
    if wq is None:
        b, b_scale = _quantize_cols(weight)  # [E, M, K] contiguous
    else:
        b, b_scale = wq
    return _rowwise_grouped_mm(rows, b, b_scale, offsets)


def _fp8_input_grad(grad, weight, offsets, wq) -> torch.Tensor:
    g, g_scale = _quantize_last(grad)  # [N, M] per row
    if wq is None:
        b, b_scale = _quantize_last(weight)  # [E, K, M] per expert and input column
    else:
        b, b_scale = wq
    return torch._scaled_grouped_mm(g, b.transpose(-2, -1), g_scale, b_scale, offsets,
                                    out_dtype=torch.bfloat16)


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, weight, offsets, fp8: bool, fwd_bits, fwd_scale, bwd_bits,
                bwd_scale):
        if fp8:
            wq = None if fwd_bits is None else (fwd_bits, fwd_scale)
            out = _fp8_forward(rows, weight, offsets, wq)
        else:
            out = F.grouped_mm(_high(rows, weight.dtype), weight, offs=offsets)
        ctx.fp8 = fp8
        ctx.rows_dtype = rows.dtype
        ctx.save_for_backward(rows, weight, offsets, bwd_bits, bwd_scale)
        return _zero_tail(out, offsets)

    @staticmethod
    def backward(ctx, grad):
        rows, weight, offsets, bwd_bits, bwd_scale = ctx.saved_tensors
        grad = grad.contiguous()
        grad_rows = grad_weight = None
        if ctx.needs_input_grad[0]:
            if ctx.fp8:
                wq = None if bwd_bits is None else (bwd_bits, bwd_scale)
                gr = _fp8_input_grad(grad, weight, offsets, wq)
            else:
                gr = F.grouped_mm(grad.to(weight.dtype), weight.transpose(-2, -1),
                                  offs=offsets)
            grad_rows = _zero_tail(gr, offsets).to(ctx.rows_dtype)
        if ctx.needs_input_grad[1]:
            a = _high(rows, weight.dtype)
            grad_weight = F.grouped_mm(a.t(), grad.to(weight.dtype), offs=offsets)
        return grad_rows, grad_weight, None, None, None, None, None, None


def _check(fn, rows, weight, offsets) -> None:
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2:
        raise ValueError(f"{fn}: rows must be a 2-D [N, K] tensor (the permuted rows), got "
                         f"{getattr(rows, 'shape', type(rows).__name__)}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
        raise ValueError(f"{fn}: weight must be a 3-D [E, K, M] tensor (one [K, M] matrix "
                         f"per expert), got {getattr(weight, 'shape', type(weight).__name__)}")
    if isinstance(weight, QuantizedTensor) or weight.dtype not in (torch.bfloat16,
                                                                   torch.float32):
        raise TypeError(f"{fn}: weight must be bf16 (or fp32 on CPU), got "
                        f"{type(weight).__name__} {weight.dtype}; keep the master weights in "
                        "high precision (the FP8 path quantizes them in the call)")
    if weight.is_cuda and weight.dtype != torch.bfloat16:
        raise TypeError(f"{fn}: CUDA grouped GEMMs take bf16 weights, got {weight.dtype}; "
                        "pass weight.bfloat16()")
    e, k, m = weight.shape
    if rows.shape[1] != k:
        raise ValueError(f"{fn}: rows are [N, {rows.shape[1]}] but weight is [E, {k}, {m}]; "
                         "the rows' width must be the weights' K")
    if not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int32 or (
            offsets.dim() != 1) or offsets.shape[0] != e:
        raise TypeError(f"{fn}: offsets must be int32 [E] = [{e}] (qmoe.expert_offsets), "
                        f"got {getattr(offsets, 'dtype', type(offsets).__name__)} "
                        f"{tuple(getattr(offsets, 'shape', ()))}")
    C.check_same_device(fn, "rows", rows, weight=weight, offsets=offsets)
    elem = weight.element_size()
    if (k * elem) % 16 or (m * elem) % 16:
        raise ValueError(f"{fn}: grouped GEMMs need rows of a multiple of 16 bytes: K={k} and "
                         f"M={m} in {weight.dtype} must be multiples of {16 // elem}; pad the "
                         "hidden and expert widths")
    if e and offsets.is_cuda and not C.is_compiling():
        check_offsets_triton(offsets, rows.shape[0])  # one launch (device assert)
    elif e:
        ok = (offsets[0] >= 0) & (offsets[-1] <= rows.shape[0])
        if e > 1:
            ok = ok & (offsets[1:] >= offsets[:-1]).all()
        # N named in eager only: formatting a symbolic N under compile would specialize it
        n = "" if C.is_compiling() else f"={rows.shape[0]}"
        C.check_values(fn, ok, f"offsets must rise from >= 0 to at most N{n} (the rows' "
                       "count); pass qmoe.expert_offsets of the permute's counts")


@C.user_errors
def grouped_mm(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *,
               weight_fp8: ExpertWeightsFP8 | None = None) -> torch.Tensor:
    """Each expert's rows times its weights: ``out[r] = rows[r] @ weight[e]`` for the rows
    ``r`` of expert ``e``'s group, ``[offsets[e-1], offsets[e])`` (``offsets[-1] = 0``).

    Args:
        rows: ``[N, K]`` bf16/fp32 (fp32 on CPU), or a qmoe FP8 tensor: per-tensor
            (``Float8Tensor``) or row-wise (``Float8BlockwiseTensor`` with one block per row)
            e4m3 rows run an FP8 grouped GEMM on Hopper; other layouts and devices are
            dequantized first (module doc). Differentiable.
        weight: ``[E, K, M]`` bf16 (fp32 allowed on CPU), the experts' matrices;
            differentiable. K and M must be multiples of 8 (16-byte rows).
        offsets: int32 ``[E]``, each group's end row, rising, at most N
            (``qmoe.expert_offsets``): checked without a host sync on CUDA (an async
            device assert), with a ``ValueError`` on CPU.
        weight_fp8: optional ``qmoe.quantize_expert_weights(weight)``: the FP8 path uses
            it instead of quantizing ``weight`` in the call (its ``bwd_*`` fields, when
            present, serve the input gradient); the other paths do not read it. Its
            shapes are checked against ``weight``; that it is ``weight``'s current
            values is the caller's promise.

    Returns ``[N, M]`` bf16 for the FP8 path, else in the weights' dtype; rows past
    ``offsets[-1]`` are zero. No host sync.
    """
    fn = "grouped_mm"
    _check(fn, rows, weight, offsets)
    wq = (None,) * 4
    if weight_fp8 is not None:
        _check_weight_fp8(fn, weight, weight_fp8)
        wq = tuple(weight_fp8)
    return _GroupedMM.apply(rows, weight, offsets, _rowwise_fp8(rows, weight.shape[2]), *wq)


def _check_weight_fp8(fn, weight, wq) -> None:
    if not isinstance(wq, ExpertWeightsFP8):
        raise TypeError(f"{fn}: weight_fp8 must be qmoe.quantize_expert_weights(weight)'s "
                        f"result, got {type(wq).__name__}")
    e, k, m = weight.shape
    want = {"fwd_bits": ((e, m, k), _E4M3), "fwd_scale": ((e, m), torch.float32),
            "bwd_bits": ((e, k, m), _E4M3), "bwd_scale": ((e, k), torch.float32)}
    for name, (shape, dtype) in want.items():
        t = getattr(wq, name)
        if t is None and name.startswith("bwd"):
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"{fn}: weight_fp8.{name} must be {dtype} {list(shape)} for "
                             f"weight [E, K, M] = {list(weight.shape)}, got "
                             f"{getattr(t, 'dtype', None)} {tuple(getattr(t, 'shape', ()))}; "
                             "pass qmoe.quantize_expert_weights(weight) of these weights")
        C.check_same_device(fn, "weight", weight, **{f"weight_fp8.{name}": t})

"""torchao's FP8 tensors through qmoe's ops, and zero-copy conversions both ways.

Importing this module (``import qmoe.interop.torchao``; qmoe's ops also import it on their
first eager call with a torchao tensor) registers, with
``torch.library.register_torch_dispatch``, a rule per torchao class for the ops that touch
``inp``: ``qmoe::permute``, ``qmoe::permute_mask`` and ``qmoe::permute_index`` (the fused
permutes CUDA takes for masks), ``qmoe::sort_chunks`` and ``qmoe::unpermute``. A registered rule
runs instead of the class's own ``__torch_dispatch__`` (which raises for every indexing op),
and rules match exact classes, so each concrete class is registered. Rules call the ops on
the raw data and scale rows and rebuild the same class, so they trace under
``torch.compile(fullgraph=True)`` exactly as qmoe's own types do (docs/torchao.md).

Layouts (T tokens, H hidden):

========================================  ==========  =========  ============================
torchao tensor                            scale       moves?     qmoe type
========================================  ==========  =========  ============================
``Float8Tensor`` PerTensor                ``(1, 1)``  carried    Float8Tensor
``Float8Tensor`` PerRow / PerBlock 1xk    ``[T, H/k]`` rows      Float8BlockwiseTensor(k)
``MXTensor`` block 32, unswizzled         ``[T, H/32]`` rows     MXFP8Tensor
``Float8TrainingTensor`` tensorwise       ``()``      carried    Float8Tensor, scale 1/s
``Float8TrainingTensor`` axiswise -1      ``[T, 1]``  rows       Float8BlockwiseTensor(H), 1/s
``Float8TrainingTensor`` axiswise 0       ``[1, H]``  carried    (ops only; no conversion)
========================================  ==========  =========  ============================

Refused with a ``ValueError``: scales with several data rows per scale row (e.g.
``PerBlock([128, 128])``), swizzled MX scales, other ranks than 2.

Scale conventions: ``Float8Tensor`` and ``MXTensor`` dequantize as ``qdata * scale``;
``Float8TrainingTensor`` as ``_data / _scale``. Rows that no route fills (padding, spare
rows) get zero data and a scale that dequantizes them to exactly zero: 0 for the
multiplying classes, 1 for ``Float8TrainingTensor`` (whose 0 would give 0 / 0).
"""

from __future__ import annotations

from typing import Any

import torch
from torchao.float8 import Float8TrainingTensor
from torchao.prototype.mx_formats.mx_tensor import MXTensor
from torchao.quantization import Float8Tensor as AOFloat8Tensor

from qmoe.ops.fp8 import RowLayout, rules
from qmoe.tensors import Float8BlockwiseTensor, Float8Tensor, MXFP8Tensor
from qmoe.tensors.layouts import (
    FP8_BLOCK_E8M0,
    FP8_BLOCK_FP32,
    FP8_DTYPES,
    FP8_PER_TENSOR,
    MX_BLOCK_SIZE,
)

__all__ = ["from_torchao", "to_torchao", "TORCHAO_CLASSES"]

TORCHAO_CLASSES = (AOFloat8Tensor, MXTensor, Float8TrainingTensor)


def _refuse(t: torch.Tensor, what: str) -> ValueError:
    return ValueError(
        f"qmoe: {type(t).__name__} with {what} has no row layout qmoe can move; "
        "requantize with one scale row per token (PerRow, PerBlock([1, k]), MX block 32 "
        "without swizzling, or a per-tensor scale)"
    )


def _parts(t: torch.Tensor):
    """``(data, scale, rows)`` of a torchao tensor: its fp8 data, its scale as stored,
    and whether the scale has one row per data row (else it carries over)."""
    if isinstance(t, MXTensor):
        if t.is_swizzled_scales:
            raise _refuse(t, "swizzled scales (is_swizzled_scales=True)")
        if t.qdata.dim() != 2 or t.block_size != MX_BLOCK_SIZE or t.qdata.dtype not in FP8_DTYPES:
            raise _refuse(t, f"block_size={t.block_size}, {t.qdata.dtype} {tuple(t.shape)}")
        return t.qdata, t.scale, True
    if isinstance(t, AOFloat8Tensor):
        data, scale = t.qdata, t.scale
    else:
        data, scale = t._data, t._scale
    if data.dim() != 2:
        raise _refuse(t, f"{data.dim()}-d data")
    if scale.numel() == 1 and (isinstance(t, AOFloat8Tensor) or t._axiswise_dim is None):
        return data, scale, False
    if isinstance(t, Float8TrainingTensor) and t._axiswise_dim in (0, -2):
        return data, scale, False  # [1, H]: one scale per column, the same for every row
    if scale.dim() == 2 and scale.shape[0] == data.shape[0]:
        return data, scale, True
    raise _refuse(t, f"a {tuple(scale.shape)} scale for {tuple(data.shape)} data")


def _rebuild(t: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A tensor of ``t``'s class and metadata around new data and scale rows."""
    if isinstance(t, MXTensor):
        return MXTensor(data, scale, t.elem_dtype, t.block_size, t.orig_dtype,
                        t.kernel_preference, t.act_quant_kwargs, t.is_swizzled_scales)
    if isinstance(t, AOFloat8Tensor):
        bs = list(t.block_size)
        # per-tensor (the scale carried over): the block is the whole tensor. A one-row
        # input's [1, H] block reads as per-tensor and per-row alike (torchao's own
        # ambiguity); its (1, 1) scale was carried, so the output is per-tensor.
        if bs[0] != 1 or scale.shape[0] != data.shape[0]:
            bs[0] = data.shape[0]
        return AOFloat8Tensor(data, scale, block_size=bs, mm_config=t.mm_config,
                              act_quant_kwargs=t.act_quant_kwargs,
                              kernel_preference=t.kernel_preference, dtype=t.dtype)
    return Float8TrainingTensor(data, scale, t._orig_dtype, t._linear_mm_config,
                                t._gemm_input_role, t._axiswise_dim)


def _scale_rows(scale: torch.Tensor) -> torch.Tensor:
    """Per-row scales as the kernels move them (e8m0 as its bytes)."""
    return scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale


class _TorchaoRows(RowLayout):
    """The rules' adapter for torchao's classes (``qmoe.ops.fp8.RowLayout``)."""

    def split(self, t):
        data, scale, rows = _parts(t)
        return data.view(torch.uint8), (_scale_rows(scale) if rows else None), scale

    def join(self, t, bits, scale):
        data_dtype = _parts_dtype(t)
        if isinstance(t, Float8TrainingTensor) and scale is not t._scale:
            # moved scale rows: unfilled rows get 1 (0 / 1 = 0, not 0 / 0)
            scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        stored = t.scale.dtype if isinstance(t, MXTensor) else scale.dtype
        return _rebuild(t, bits.view(data_dtype), scale.view(stored))

    def merge_layout(self, t):
        if isinstance(t, Float8TrainingTensor):
            return None  # data / scale: its own convention, dequantized first
        data, scale, rows = _parts(t)
        if isinstance(t, MXTensor):
            layout, bs, s = FP8_BLOCK_E8M0, MX_BLOCK_SIZE, scale.view(torch.uint8)
        elif rows:
            layout, bs, s = FP8_BLOCK_FP32, data.shape[1] // scale.shape[1], scale
        else:
            layout, bs, s = FP8_PER_TENSOR, 0, scale.reshape(())
        return layout, bs, s, data.dtype, t.dtype

    def dequantized(self, t):
        data, scale, _ = _parts(t)
        return data.float() / scale, t._orig_dtype


def _parts_dtype(t: torch.Tensor) -> torch.dtype:
    """The fp8 dtype of a torchao tensor's data."""
    return t.qdata.dtype if isinstance(t, (MXTensor, AOFloat8Tensor)) else t._data.dtype


#: The adapter of torchao's classes.
TORCHAO_ROWS = _TorchaoRows()

for _op, _rule in rules(TORCHAO_ROWS).items():
    for _cls in TORCHAO_CLASSES:
        torch.library.register_torch_dispatch(
            _op, _cls, lambda cls, func, types, args, kwargs, rule=_rule: rule(func, args, kwargs))


def from_torchao(t: torch.Tensor) -> torch.Tensor:
    """The qmoe tensor for a torchao FP8 tensor, sharing its fp8 data (and its scale, but
    where the convention is inverted: ``Float8TrainingTensor``'s ``1 / scale`` is a new
    tensor of T or 1 values, and dequantizing multiplies by it, which may differ from
    torchao's ``data / scale`` in the last fp32 bit). Layouts: module docs."""
    if not isinstance(t, TORCHAO_CLASSES):
        names = ", ".join(c.__name__ for c in TORCHAO_CLASSES)
        raise TypeError(f"from_torchao: expected one of torchao's {names}, got {type(t).__name__}")
    data, scale, rows = _parts(t)
    if isinstance(t, MXTensor):
        return MXFP8Tensor(data, scale, t.orig_dtype)
    if isinstance(t, AOFloat8Tensor):
        if not rows:
            return Float8Tensor(data, scale.reshape(()), t.dtype)
        return Float8BlockwiseTensor(data, scale, t.dtype, data.shape[1] // scale.shape[1])
    if not rows and t._axiswise_dim is not None:
        raise _refuse(t, "per-column (axiswise_dim=0) scales")
    inv = scale.reciprocal()
    if not rows:
        return Float8Tensor(data, inv.reshape(()), t._orig_dtype)
    return Float8BlockwiseTensor(data, inv, t._orig_dtype, data.shape[1])


def to_torchao(t: torch.Tensor, cls: type, **kwargs: Any) -> torch.Tensor:
    """A torchao tensor of class ``cls`` sharing qmoe tensor ``t``'s fp8 data.

    * ``Float8Tensor`` from qmoe's per-tensor or blockwise types (blocks must tile H);
      ``kwargs`` go to its constructor (``mm_config``, ``kernel_preference``, ...).
    * ``MXTensor`` from ``MXFP8Tensor``; ``kernel_preference`` (default EMULATED, as
      ``MXTensor.to_mx``) and ``act_quant_kwargs`` may be given.
    * ``Float8TrainingTensor`` from per-tensor or per-row (one block of H) types, with
      ``1 / scale``; ``linear_mm_config`` and ``gemm_input_role`` may be given.
    """
    kind = type(t).__name__
    if not isinstance(t, (Float8Tensor, Float8BlockwiseTensor, MXFP8Tensor)):
        raise TypeError(f"to_torchao: expected a qmoe quantized tensor, got {kind}")
    if t.qdata.dim() != 2:
        raise ValueError(f"to_torchao: expected a 2-d {kind}, got shape {tuple(t.shape)}")
    tt, h = t.qdata.shape
    if cls is MXTensor:
        if not isinstance(t, MXFP8Tensor):
            raise ValueError(f"to_torchao: MXTensor needs an MXFP8Tensor, got {kind}")
        if h % MX_BLOCK_SIZE:
            raise ValueError(f"to_torchao: MXTensor needs whole 1x{MX_BLOCK_SIZE} blocks, "
                             f"H={h} is not a multiple of {MX_BLOCK_SIZE}")
        if not (t.qdata.is_contiguous() and t.scale_bits.is_contiguous()):
            raise ValueError("to_torchao: MXTensor needs contiguous data and scales (its "
                             "dequantize asserts it); pass t.contiguous()")
        from torchao.quantization.quantize_.common import KernelPreference

        return MXTensor(t.qdata, t.scale, t.qdata.dtype, MX_BLOCK_SIZE, t.orig_dtype,
                        kwargs.get("kernel_preference", KernelPreference.EMULATED),
                        kwargs.get("act_quant_kwargs"), False)
    if isinstance(t, MXFP8Tensor):
        raise ValueError(f"to_torchao: an MXFP8Tensor maps onto MXTensor only, not {cls.__name__}")
    # one block over the row (qmoe.RowWise: block_size = next_pow2(H) >= H) is torchao's
    # per-row block [1, H]
    bs = None if isinstance(t, Float8Tensor) else min(t.block_size, h)
    if bs is not None and h % bs:
        raise ValueError(f"to_torchao: block_size={t.block_size} does not tile H={h}; torchao "
                         "needs whole blocks")
    if cls is AOFloat8Tensor:
        if isinstance(t, Float8Tensor):
            return AOFloat8Tensor(t.qdata, t.scale.reshape(1, 1), block_size=[tt, h],
                                  dtype=t.orig_dtype, **kwargs)
        return AOFloat8Tensor(t.qdata, t.scale, block_size=[1, bs], dtype=t.orig_dtype,
                              **kwargs)
    if cls is Float8TrainingTensor:
        from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig

        mm = kwargs.get("linear_mm_config") or LinearMMConfig()
        role = kwargs.get("gemm_input_role", GemmInputRole.INPUT)
        if isinstance(t, Float8Tensor):
            return Float8TrainingTensor(t.qdata, t.scale.reciprocal(), t.orig_dtype, mm, role)
        if bs != h:
            raise ValueError(f"to_torchao: Float8TrainingTensor takes per-row scales (one block "
                             f"of H={h}), got block_size={t.block_size}")
        return Float8TrainingTensor(t.qdata, t.scale.reciprocal(), t.orig_dtype, mm, role, -1)
    raise TypeError(f"to_torchao: cls must be one of {[c.__name__ for c in TORCHAO_CLASSES]}, "
                    f"got {getattr(cls, '__name__', cls)}")

"""Loading quantized tensors: every load path ends in a validated tensor.

torch rebuilds a pickled tensor subclass in two steps: a rebuild function makes the tensor
(``rebuild_quantized`` for qmoe's format, ``torch._utils._rebuild_wrapper_subclass`` for
files of torch's own tensor reduction), then ``_rebuild_from_type_v2`` applies the pickled
Python state through the type's ``__setstate__``. A check in the first step alone would
let the state replace ``scale`` or ``qdata`` unchecked, so :func:`set_state` (the
subclass's ``__setstate__``) refuses state that changes a field, builds the fields of a
bare wrapper through the constructor, and ends in :func:`validate`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from qmoe.tensors.layouts import check_block_size

if TYPE_CHECKING:
    from qmoe.tensors.base import QuantizedTensor

_FILE_FIX = ("the file (or state) is corrupt or hand-made, not what torch.save of a valid "
             "tensor writes; quantize the source again and save that")


def _holds_values(t: torch.Tensor) -> bool:
    """Whether ``t``'s values can be read (not meta, fake or traced)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return not (t.device.type == "meta" or torch.compiler.is_compiling()
                or isinstance(t, FakeTensor))


def _describe(v: Any) -> str:
    return f"a {tuple(v.shape)} {v.dtype} tensor" if isinstance(v, torch.Tensor) else repr(v)


def _same_value(a: Any, b: Any) -> bool:
    """Same type and equal (a tensor against a number is not)."""
    return type(a) is type(b) and bool(a == b)


def _first(mask: torch.Tensor, values: torch.Tensor) -> str:
    """``value at index`` of the first True of ``mask`` (one host read)."""
    idx = tuple(int(i) for i in mask.nonzero()[0])
    return f"{values[idx].item()} at index {idx}" if idx else f"{values.item()}"


def _same_tensor(a: Any, b: torch.Tensor) -> bool:
    """Same dtype, shape, strides, device and bytes (NaN equals itself)."""
    return a is b or (
        isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        and a.stride() == b.stride() and a.device == b.device
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def validate(t: QuantizedTensor) -> None:
    """Check ``t`` as a load must leave it (``QuantizedTensor.validate``); raise
    ``ValueError`` / ``TypeError``.

    Layout: the constructor's checks (fp8 ``qdata`` ``[..., H]``, scale dtype, shape
    and device, ``orig_dtype``, ``block_size``), inner tensors plain (not quantized),
    and the wrapper's own metadata (shape, strides, storage offset, dtype
    ``orig_dtype``, device, strided layout) equal to what the constructor derives
    from ``qdata``. Values: an fp32 scale (per-tensor, blockwise) is positive, and
    non-finite (NaN or +inf) only for a block whose fp8 data holds a NaN, which is
    what ``quantize`` writes for a block with NaN or inf input; e8m0 scale bytes are
    all valid (255 is NaN). The value check reads the scale (a host sync on CUDA;
    ``qdata`` too when a scale is non-finite), so it runs at load time and in
    ``copy.deepcopy``, not in the constructor, which every op calls; it is skipped
    for meta and fake tensors and while compiling. Call it on tensors you build from
    outside data.
    """
    name = type(t).__name__
    d = vars(t)
    missing = [n for n in t._fields if n not in d]
    if missing:
        raise ValueError(f"{name}: no {', '.join(sorted(missing))}: the tensor was "
                         f"built without its fields; {_FILE_FIX}")
    for n in t.tensor_data_names:
        inner = d[n]
        # a quantized inner tensor (any QuantizedTensor has the class attribute _fields;
        # this module does not import base, which imports it)
        if not isinstance(inner, torch.Tensor) or hasattr(type(inner), "_fields"):
            raise TypeError(f"{name}: {n} must be a plain tensor, got {type(inner).__name__}")
    for n in t._field_names - t._fields:  # class constants (block_size)
        if n in d:
            raise ValueError(f"{name}: {n} is fixed by the class "
                             f"({getattr(type(t), n)!r}) and cannot be "
                             f"{_describe(d[n])}")
    if t.block_size is not None:
        check_block_size(name, t.block_size)
    t._check_layout()
    _check_wrapper(t)
    _check_scale_values(t)


def _check_wrapper(t: QuantizedTensor) -> None:
    """The wrapper's metadata is the constructor's: ``qdata``'s and ``orig_dtype``."""
    name, q = type(t).__name__, t.qdata
    if t.data_ptr() != 0:
        raise ValueError(f"{name}: not a wrapper tensor (it holds storage of its own: a "
                         f"plain tensor turned into the type); {_FILE_FIX}")
    got = (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype,
           t.device, t.layout)
    want = (tuple(q.shape), q.stride(), 0, t.orig_dtype, q.device, torch.strided)
    what = ("shape", "strides", "storage offset", "dtype", "device", "layout")
    for w, g, e in zip(what, got, want):
        if g != e:
            raise ValueError(
                f"{name}: the tensor reports {w} {g} but its qdata {tuple(q.shape)} "
                f"{q.dtype} / orig_dtype {t.orig_dtype} give {e}; {_FILE_FIX}")


def _check_scale_values(t: QuantizedTensor) -> None:
    """fp32 scales: positive; NaN or +inf only for a block whose data holds a NaN."""
    s = t.raw_scale
    if s.dtype != torch.float32 or not _holds_values(s):
        return
    nonpositive = s <= 0  # zero, negative, -inf
    nonfinite = ~torch.isfinite(s)
    if not bool((nonpositive | nonfinite).any()):  # the one host read of a sound scale
        return
    name = type(t).__name__
    if bool(nonpositive.any()):
        raise ValueError(
            f"{name}: scale {_first(nonpositive, s)} is not positive; a scale is "
            f"max(amax, 1e-12) / fp8_max, never zero or negative; {_FILE_FIX}")
    stray = nonfinite & ~_blocks_with_nan(t)
    if bool(stray.any()):
        raise ValueError(
            f"{name}: scale {_first(stray, s)} is non-finite in a block whose fp8 data "
            "holds no NaN (quantize writes a NaN or +inf scale only for a block with NaN "
            f"or inf input, and that block's data holds NaN); {_FILE_FIX}")


def _blocks_with_nan(t: QuantizedTensor) -> torch.Tensor:
    """Bool, the scale's shape: whether each block's fp8 data holds a NaN code."""
    b = t.qdata.view(torch.uint8) & 0x7F
    nan = b == 0x7F if t.qdata.dtype == torch.float8_e4m3fn else b > 0x7C
    if t.block_size is None:
        return nan.any()
    h, bs = nan.shape[-1], t.block_size
    padded = nan.new_zeros((*nan.shape[:-1], -(-h // bs) * bs))
    padded[..., :h] = nan
    return padded.reshape(*nan.shape[:-1], -1, bs).any(-1)


def set_state(t: QuantizedTensor, state: Any) -> None:
    """Apply a pickled Python state to ``t``, then :func:`validate` (the subclass's
    ``__setstate__``).

    torch's ``_rebuild_from_type_v2`` calls this after building the tensor, for every
    load (``weights_only`` or not, plain ``pickle``, ``copy.copy``). In qmoe's format
    the tensor comes from ``rebuild_quantized`` and the state holds only user
    attributes (``_is_param``, ...): a field there must equal the tensor's. In files
    of torch's own tensor reduction the tensor is a bare wrapper made by
    ``_rebuild_wrapper_subclass`` from the file's shape, strides and dtype, and the
    state holds every field: they are checked by the constructor's rules, and the
    wrapper against them.
    """
    name = type(t).__name__
    parts = state if isinstance(state, tuple) else (state,)
    if len(parts) not in (1, 2):
        raise ValueError(f"{name}: a pickled state is a dict or (dict, slots), got a "
                         f"{len(parts)}-tuple; {_FILE_FIX}")
    items: dict[str, Any] = {}
    for part in parts:
        if part is None:  # Python 3.11+ writes None for an empty __dict__
            continue
        if not isinstance(part, dict):
            raise TypeError(f"{name}: a pickled state is a dict, got "
                            f"{type(part).__name__}; {_FILE_FIX}")
        items.update(part)
    for k in items:
        if not isinstance(k, str) or k.startswith("__"):
            raise ValueError(f"{name}: the pickled state names {k!r}, which is no "
                             f"attribute; {_FILE_FIX}")
    fields = {k: items.pop(k) for k in list(items) if k in t._field_names}
    if "qdata" in vars(t):
        for k, v in fields.items():
            cur = getattr(t, k)
            same = (_same_tensor(v, cur) if isinstance(cur, torch.Tensor)
                    else _same_value(v, cur))
            if not same:
                raise ValueError(
                    f"{name}: the pickled state sets {k}, which the tensor's "
                    f"constructor arguments already set, to a different value; "
                    f"{_FILE_FIX}")
    else:
        _set_fields(t, fields)
    for k, v in items.items():
        setattr(t, k, v)
    validate(t)


def _set_fields(t: QuantizedTensor, fields: dict[str, Any]) -> None:
    """The fields of a bare wrapper (torch's own reduction), through the
    constructor's checks."""
    name, scale_name = type(t).__name__, t.tensor_data_names[1]
    if scale_name not in fields and "scale" in fields:  # MX files from before scale_bits
        fields[scale_name] = fields.pop("scale")
    missing = [n for n in (*t.tensor_data_names, *t.tensor_attribute_names)
               if n not in fields]
    if missing:
        raise ValueError(f"{name}: the pickled state lacks {', '.join(missing)}; torch's "
                         f"own tensor reduction writes every field; {_FILE_FIX}")
    for n, v in fields.items():
        if n not in t._fields and not _same_value(v, getattr(type(t), n)):
            raise ValueError(f"{name}: the pickled state sets {n} to {_describe(v)}, but "
                             f"it is fixed by the class; {_FILE_FIX}")
    for n in t.tensor_data_names:
        if not isinstance(fields[n], torch.Tensor):
            raise TypeError(f"{name}: {n} must be a tensor, got {type(fields[n]).__name__}")
    ref = type(t)(*(fields[n] for n in t.tensor_data_names),
                     *(fields[n] for n in t.tensor_attribute_names))
    for n in t._fields:
        setattr(t, n, getattr(ref, n))


"""aten ops that keep ``qdata`` and ``scale`` consistent, one small function per op.

Registered on ``QuantizedTensor`` so every layout shares them. The rule they follow:
an op along a *leading* dim is applied to ``qdata`` and, for block scales, to ``scale``
alike; a per-tensor scale carries over. Along the last dim (H), block scales allow only
what cannot cut through a scale block: a ``slice`` with bounds on block edges; everything
else along H (``select``, ``stack``, ``cat``, ``index_select`` along H, ...) raises
``ValueError``. A per-tensor scale allows every op along H (``slice``, ``cat``, ``split``,
``index_select``, ...) except ``select`` and ``stack`` into a new last dim, which raise.
"""

from __future__ import annotations

import torch

from qmoe.tensors.base import QuantizedTensor

aten = torch.ops.aten
implements = QuantizedTensor.implements


def _norm_dim(dim: int, ndim: int, op: str) -> int:
    if not -ndim <= dim < ndim:
        raise IndexError(f"{op}: dim {dim} out of range for a {ndim}-d tensor")
    return dim % ndim


def _leading_dim(x: QuantizedTensor, dim: int, op: str) -> int:
    """Normalize ``dim``; raise if it is the last (blocked) dim of a block-scaled tensor."""
    d = _norm_dim(dim, x.dim(), op)
    if d == x.dim() - 1 and x.block_size is not None:
        raise ValueError(
            f"{op} along the last dim (H) of a {type(x).__name__} would cut through its "
            f"1x{x.block_size} scale blocks; dequantize() first or act on leading dims"
        )
    return d


def _bytewise(fn):
    """``fn`` run on a ``uint8`` view of 1-byte data (fp8 qdata, e8m0 bits) and viewed back
    (bit-identical): torch 2.9's CPU ``index`` has no fp8 kernel ('"index_cpu" not
    implemented for 'Float8_e4m3fn''); the gathers below go through bytes on every version."""

    def run(t: torch.Tensor) -> torch.Tensor:
        if t.element_size() == 1:
            return fn(t.view(torch.uint8)).view(t.dtype)
        return fn(t)

    return run


@implements([aten.detach.default, aten.alias.default])
def _detach(func, types, args, kwargs):
    return args[0].map_rows(func)


@implements(aten.clone.default)
def _clone(func, types, args, kwargs):
    fmt = kwargs.get("memory_format", torch.preserve_format)
    if fmt not in (torch.preserve_format, torch.contiguous_format):
        raise ValueError(f"clone: quantized tensors support contiguous layouts only, got {fmt}")
    x = args[0]
    if x.block_size is None:  # a clone owns its per-tensor scale too (no in-place aliasing)
        return x._rewrap(x.qdata.clone(memory_format=fmt), x.raw_scale.clone())
    return x.map_rows(lambda t: t.clone(memory_format=fmt))


@implements(aten._to_copy.default)
def _to_copy(func, types, args, kwargs):
    x = args[0]
    kwargs = dict(kwargs)
    dtype = kwargs.pop("dtype", None)
    device = kwargs.pop("device", None)
    non_blocking = kwargs.pop("non_blocking", False)
    if dtype is not None and dtype != x.dtype:
        # A dtype cast leaves the quantized world.
        return x._dequantize_raw(dtype).to(device=device, non_blocking=non_blocking)
    mv = lambda t: t.to(device=device, non_blocking=non_blocking, copy=True)
    return x._rewrap(mv(x.qdata), mv(x.raw_scale))


@implements(aten.is_pinned.default)
def _is_pinned(func, types, args, kwargs):
    return args[0].qdata.is_pinned()


@implements([aten.view.default, aten._unsafe_view.default])
def _view(func, types, args, kwargs):
    x, size = args[0], args[1]
    qdata = func(x.qdata, size)
    if x.block_size is not None and (qdata.dim() == 0 or qdata.shape[-1] != x.shape[-1]):
        raise ValueError(
            f"view/reshape of a {type(x).__name__} from {tuple(x.shape)} to "
            f"{tuple(qdata.shape)} changes the last dim (H), which its scale blocks "
            "cover; only leading dims may be reshaped"
        )
    if qdata.dim() == 0:
        raise ValueError("view/reshape: a quantized tensor needs at least one dim")
    return x._rewrap(qdata, x.raw_scale if x.block_size is None else x.raw_scale.reshape(
        *qdata.shape[:-1], x.raw_scale.shape[-1]))


def _slice_args(x, dim=0, start=None, end=None, step=1):
    return x, dim, start, end, step


@implements(aten.slice.Tensor)
def _slice(func, types, args, kwargs):
    x, dim, start, end, step = _slice_args(*args, **kwargs)
    d = _norm_dim(dim, x.dim(), "slice")
    if d < x.dim() - 1 or x.block_size is None:
        return x.map_rows(lambda t: func(t, d, start, end, step))
    # Slicing H of a block-scaled tensor: the cut must fall on block edges.
    h, bs = x.shape[-1], x.block_size
    lo, hi, _ = slice(start, end, step).indices(h)
    hi = max(hi, lo)
    if hi == lo:  # an empty slice cuts no block
        return x._rewrap(x.qdata[..., lo:lo], x.raw_scale[..., :0])
    if step != 1 or lo % bs or (hi % bs and hi != h):
        raise ValueError(
            f"slice of H [{start}:{end}:{step}] on a {type(x).__name__} (H={h}) cuts "
            f"through its 1x{bs} scale blocks; bounds must be multiples of {bs} (or H) "
            "with step 1"
        )
    return x._rewrap(x.qdata[..., lo:hi], x.raw_scale[..., lo // bs : -(-hi // bs)])


@implements(aten.select.int)
def _select(func, types, args, kwargs):
    x, dim, index = args
    if x.dim() == 1:
        raise ValueError(
            f"select on a 1-d {type(x).__name__} would leave a scalar; quantized tensors "
            "keep at least the H dim"
        )
    d = _norm_dim(dim, x.dim(), "select")
    if d == x.dim() - 1:
        raise ValueError(f"select along the last dim (H) of a {type(x).__name__} is not supported")
    return x.map_rows(lambda t: func(t, d, index))


@implements(aten.unsqueeze.default)
def _unsqueeze(func, types, args, kwargs):
    x, dim = args
    d = _norm_dim(dim, x.dim() + 1, "unsqueeze")
    if d == x.dim():
        raise ValueError(f"unsqueeze after the last dim (H) of a {type(x).__name__} would move "
                         "H off the last dim; unsqueeze a leading dim")
    return x.map_rows(lambda t: func(t, d))


@implements([aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims])
def _squeeze(func, types, args, kwargs):
    x = args[0]
    dims = args[1] if len(args) > 1 else kwargs.get("dim", tuple(range(x.dim())))
    dims = {_norm_dim(d, x.dim(), "squeeze") for d in
            (dims if isinstance(dims, (list, tuple)) else [dims])}
    if x.dim() - 1 in dims and x.shape[-1] == 1:
        if func is not aten.squeeze.default:
            raise ValueError(f"squeeze of the last dim (H = 1) of a {type(x).__name__} would "
                             "leave it without H; squeeze leading dims only")
        dims.discard(x.dim() - 1)  # squeeze(): every size-1 dim but H
    lead = tuple(d for d in sorted(dims) if d < x.dim() - 1 and x.shape[d] == 1)
    return x.map_rows(lambda t: t.squeeze(lead))


@implements(aten.unbind.int)
def _unbind(func, types, args, kwargs):
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    d = _norm_dim(dim, x.dim(), "unbind")
    if d == x.dim() - 1:
        raise ValueError(f"unbind along the last dim (H) of a {type(x).__name__} would leave "
                         "no H; unbind a leading dim")
    return [x.map_rows(lambda t, i=i: t.select(d, i)) for i in range(x.shape[d])]


@implements(aten.expand.default)
def _expand(func, types, args, kwargs):
    x, size = args[0], list(args[1])
    if size[-1] not in (-1, x.shape[-1]):
        raise ValueError(f"expand of a {type(x).__name__} may not change the last dim (H="
                         f"{x.shape[-1]}), got {tuple(size)}")
    return x.map_rows(lambda t: t.expand(size),
                      scale_fn=lambda s: s.expand(*size[:-1], s.shape[-1]))


@implements([aten.split.Tensor, aten.split_with_sizes.default])
def _split(func, types, args, kwargs):
    x, sizes = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    d = _leading_dim(x, dim, "split")
    qs = func(x.qdata, sizes, d)
    ss = func(x.raw_scale, sizes, d) if x.block_size is not None else [x.raw_scale] * len(qs)
    return [x._rewrap(q, s) for q, s in zip(qs, ss)]


@implements(aten.index_select.default)
def _index_select(func, types, args, kwargs):
    x, dim, index = args
    d = _leading_dim(x, dim, "index_select")
    return x.map_rows(_bytewise(lambda t: func(t, d, index)))


def _indexes_last_dim(indices, ndim: int) -> bool:
    """Whether an ``aten.index`` index list reaches the last dim: a bool (or uint8) mask
    covers as many dims as it has, any other index tensor one, ``None`` one (unindexed)."""
    d = 0
    for i in indices:
        width = i.dim() if i is not None and i.dtype in (torch.bool, torch.uint8) else 1
        if i is not None and d + width >= ndim:
            return True
        d += width
    return False


@implements(aten.index.Tensor)
def _index(func, types, args, kwargs):
    x, indices = args
    if x.block_size is not None and _indexes_last_dim(indices, x.dim()):
        raise ValueError(
            f"advanced indexing along the last dim (H) of a {type(x).__name__} would cut "
            "through its scale blocks; index leading dims only"
        )
    return x.map_rows(_bytewise(lambda t: func(t, indices)))


def _check_same_layout(tensors, op: str) -> QuantizedTensor:
    first = next((t for t in tensors if isinstance(t, QuantizedTensor)), tensors[0])
    for t in tensors:
        if not isinstance(t, QuantizedTensor) or not first.same_layout(t):
            raise TypeError(
                f"{op}: all inputs must be quantized with one recipe; got "
                f"{type(first).__name__}({first.fp8_dtype}, {first._attrs()}) and "
                + (
                    f"{type(t).__name__}({t.fp8_dtype}, {t._attrs()})"
                    if isinstance(t, QuantizedTensor)
                    else f"a plain {t.dtype} tensor"
                )
                + "; dequantize or requantize them to one recipe first"
            )
    return first


def _common_scale_qdata(tensors) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per-tensor scales: bring every qdata to the largest scale.

    Bit-exact when all scales are equal (the factor is exactly 1); otherwise each
    element is rescaled by ``s_i / s_max <= 1`` and rounded once to fp8. No host sync.
    """
    scale = torch.stack([t.raw_scale for t in tensors]).amax()
    fp8 = tensors[0].fp8_dtype
    qs = [(t.qdata.float() * (t.raw_scale / scale)).to(fp8) for t in tensors]
    return qs, scale


@implements(aten.cat.default)
def _cat(func, types, args, kwargs):
    tensors = list(args[0])
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    first = _check_same_layout(tensors, "cat")
    d = _leading_dim(first, dim, "cat")
    if first.block_size is None:
        qs, scale = _common_scale_qdata(tensors)
        return first._rewrap(torch.cat(qs, d), scale)
    return first._rewrap(
        torch.cat([t.qdata for t in tensors], d), torch.cat([t.raw_scale for t in tensors], d)
    )


@implements(aten.stack.default)
def _stack(func, types, args, kwargs):
    tensors = list(args[0])
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    first = _check_same_layout(tensors, "stack")
    d = _norm_dim(dim, first.dim() + 1, "stack")
    if d == first.dim():
        raise ValueError("stack: the new dim must come before the last dim (H)")
    if first.block_size is None:
        qs, scale = _common_scale_qdata(tensors)
        return first._rewrap(torch.stack(qs, d), scale)
    return first._rewrap(
        torch.stack([t.qdata for t in tensors], d), torch.stack([t.raw_scale for t in tensors], d)
    )


@implements(aten.empty_like.default)
def _empty_like(func, types, args, kwargs):
    x = args[0]
    kwargs = dict(kwargs)
    dtype = kwargs.pop("dtype", None)
    if dtype is not None and dtype != x.dtype:
        return torch.empty(x.shape, dtype=dtype, device=kwargs.get("device") or x.device)
    device = kwargs.pop("device", None)
    return x._rewrap(
        torch.empty_like(x.qdata, device=device), torch.empty_like(x.raw_scale, device=device)
    )


@implements(aten.copy_.default)
def _copy_(func, types, args, kwargs):
    dst, src = args[0], args[1]
    if not isinstance(dst, QuantizedTensor):
        return dst.copy_(src._dequantize_raw(dst.dtype))
    if not dst.same_layout(src):
        raise TypeError(
            f"copy_ into a {type(dst).__name__} needs a source of the same recipe, got "
            f"{type(src).__name__ if isinstance(src, QuantizedTensor) else 'a plain tensor'}"
            "; quantize the source with qmoe.quantize(src, recipe) first"
        )
    if dst.shape != src.shape:
        raise ValueError(f"copy_: shapes differ: {tuple(dst.shape)} vs {tuple(src.shape)}")
    dst.qdata.copy_(src.qdata)
    dst.raw_scale.copy_(src.raw_scale)
    return dst

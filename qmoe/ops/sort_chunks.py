"""``moe_sort_chunks_by_index``: reorder row chunks (``qmoe::sort_chunks``).

Used after an expert-parallel all-to-all to regroup the received chunks by local expert.
Glossary: T rows, H hidden, C chunks.
"""

from __future__ import annotations

import torch

from qmoe._library import define
from qmoe.ops import checks as C
from qmoe.ops.kernels.sort_chunks import gather_rows_triton, sort_chunks_triton
from qmoe.ops.tuning import MAX_KERNEL_CHUNKS


def one_launch(inp: torch.Tensor, split_sizes: torch.Tensor) -> bool:
    """Whether the sort of ``inp`` takes ``sort_chunks_triton`` (CUDA, at most
    ``MAX_KERNEL_CHUNKS`` chunks), which also checks the sizes, the order and the probs."""
    return inp.is_cuda and split_sizes.numel() <= MAX_KERNEL_CHUNKS


def chunk_source_rows(
    split_sizes: torch.Tensor, sorted_index: torch.Tensor, t: int
) -> torch.Tensor:
    """``src [T]`` int64: output row r reads input row ``src[r]``. Device ops only.

    Chunk ``sorted_index[j]`` is emitted j-th; rows past ``sum(split_sizes)`` stay put.
    """
    dev = split_sizes.device
    r = torch.arange(t, device=dev)
    c = split_sizes.numel()
    if c == 0:
        return r
    sizes = split_sizes.long()
    in_start = torch.cumsum(sizes, 0) - sizes
    idx = sorted_index.long()
    out_end = torch.cumsum(sizes[idx], 0)
    j = torch.searchsorted(out_end, r, right=True)  # position of row r's chunk
    jc = j.clamp(max=c - 1)
    src = in_start[idx[jc]] + r - (out_end[jc] - sizes[idx[jc]])
    # Past the sorted chunks rows stay in place; the clamp keeps even inconsistent input
    # (sizes summing past T) inside the tensor.
    return torch.where(j < c, src, r).clamp(0, max(t - 1, 0))


@define(
    "sort_chunks(Tensor inp, Tensor split_sizes, Tensor sorted_index, Tensor? probs) "
    "-> (Tensor, Tensor)"
)
def _sort_chunks(
    inp: torch.Tensor,
    split_sizes: torch.Tensor,
    sorted_index: torch.Tensor,
    probs: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H], probs moved alike [T] or empty)``: torch's gather of the source
    rows (``chunk_source_rows``)."""
    src = chunk_source_rows(split_sizes, sorted_index, inp.shape[0])
    out = inp.index_select(0, src)
    return out, (probs.index_select(0, src) if probs is not None else inp.new_empty(0))


@_sort_chunks.register_cuda
def _sort_chunks_cuda(inp, split_sizes, sorted_index, probs):
    """One launch up to ``MAX_KERNEL_CHUNKS`` chunks (it checks the sizes, the order and
    the probs itself); past that, the source rows then a gather."""
    if one_launch(inp, split_sizes):
        return sort_chunks_triton(inp, split_sizes, sorted_index, probs)
    src = chunk_source_rows(split_sizes, sorted_index, inp.shape[0])
    out = gather_rows_triton(inp, src)
    return out, (probs.index_select(0, src) if probs is not None else inp.new_empty(0))


@_sort_chunks.register_fake
def _(inp, split_sizes, sorted_index, probs):  # outputs contiguous whatever inp's strides
    pp = probs.new_empty(probs.shape) if probs is not None else inp.new_empty(0)
    return inp.new_empty(inp.shape), pp


def _sort_setup(ctx, inputs, output):
    inp, split_sizes, sorted_index, probs = inputs
    ctx.save_for_backward(split_sizes, sorted_index)
    ctx.has_probs = probs is not None


@define(
    "sort_chunks_backward(Tensor grad_out, Tensor split_sizes, Tensor sorted_index, "
    "Tensor? grad_probs) -> (Tensor, Tensor)"
)
def _sort_chunks_backward(
    grad_out: torch.Tensor,
    split_sizes: torch.Tensor,
    sorted_index: torch.Tensor,
    grad_probs: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk sort's inverse movement: ``(grad_inp [T, H], grad_probs [T] or empty)``.
    CUDA up to ``one_launch``'s chunk count: the one-launch kernel run backwards (the
    forward checked that the order is a permutation); otherwise (CPU, or more chunks): an
    fp32 ``index_add`` over the forward's source rows (fp64 for fp64 probs), right even if
    ``sorted_index`` repeated a chunk."""
    t = grad_out.shape[0]
    src = chunk_source_rows(split_sizes, sorted_index, t)
    gi = torch.zeros(grad_out.shape, dtype=torch.float32, device=grad_out.device)
    gi = gi.index_add(0, src, grad_out.float()).to(grad_out.dtype)
    gp = grad_out.new_empty(0)
    if grad_probs is not None:  # fp64 router probs keep fp64
        acc = torch.promote_types(grad_probs.dtype, torch.float32)
        gp = torch.zeros(t, dtype=acc, device=grad_probs.device)
        gp = gp.index_add(0, src, grad_probs.to(acc)).to(grad_probs.dtype)
    return gi, gp


@_sort_chunks_backward.register_cuda
def _sort_chunks_backward_cuda(grad_out, split_sizes, sorted_index, grad_probs):
    if one_launch(grad_out, split_sizes):
        return sort_chunks_triton(grad_out, split_sizes, sorted_index, grad_probs,
                                  inverse=True, check=False)
    return _sort_chunks_backward.fn(grad_out, split_sizes, sorted_index, grad_probs)


@_sort_chunks_backward.register_fake
def _(grad_out, split_sizes, sorted_index, grad_probs):
    gp = grad_probs.new_empty(grad_probs.shape) if grad_probs is not None else grad_out.new_empty(0)
    return grad_out.new_empty(grad_out.shape), gp


def _moved_back(op):
    """The autograd rule of a movement whose gradient is the movement ``op``: the sort's is
    its inverse (``sort_chunks_backward``), the inverse's is the sort. Both take
    ``(rows, split_sizes, sorted_index, probs or None)`` and give ``(rows, probs)``."""

    def backward(ctx, grad_rows, grad_probs):
        split_sizes, sorted_index = ctx.saved_tensors
        gp_in = grad_probs if ctx.has_probs else None
        gi, gp = op(grad_rows, split_sizes, sorted_index, gp_in)
        return gi, None, None, gp if gp_in is not None else None

    return backward


_sort_chunks.register_autograd(_moved_back(_sort_chunks_backward), setup_context=_sort_setup)
_sort_chunks_backward.register_autograd(_moved_back(_sort_chunks), setup_context=_sort_setup)


@define(
    "sort_chunks_rows(Tensor inp, Tensor side, Tensor split_sizes, Tensor sorted_index, "
    "Tensor? probs) -> (Tensor, Tensor, Tensor)"
)
def _sort_chunks_rows(
    inp: torch.Tensor,
    side: torch.Tensor,
    split_sizes: torch.Tensor,
    sorted_index: torch.Tensor,
    probs: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out [T, H], side_out [T, NS], permuted probs [T] or empty)``: the chunk sort of
    rows with side rows (the block scales of quantized rows) moved alike. On CUDA one
    launch (the scale rows ride in the bits' programs); elsewhere two sorts. Called by the
    quantized types' passthrough rule of ``qmoe::sort_chunks``, below autograd."""
    out, pp = _sort_chunks(inp, split_sizes, sorted_index, probs)
    return out, _sort_chunks(side, split_sizes, sorted_index, None)[0], pp


@_sort_chunks_rows.register_cuda
def _sort_chunks_rows_cuda(inp, side, split_sizes, sorted_index, probs):
    if one_launch(inp, split_sizes):
        so = side.new_empty(side.shape)
        out, pp = sort_chunks_triton(inp, split_sizes, sorted_index, probs, side,
                                     side_out=so)
        return out, so, pp
    return _sort_chunks_rows.fn(inp, side, split_sizes, sorted_index, probs)


@_sort_chunks_rows.register_fake
def _(inp, side, split_sizes, sorted_index, probs):
    pp = probs.new_empty(probs.shape) if probs is not None else inp.new_empty(0)
    return inp.new_empty(inp.shape), side.new_empty(side.shape), pp


def _check(fn, inp, split_sizes, sorted_index, probs):
    C.check_input(fn, inp)
    C.check_tensor(fn, "split_sizes", split_sizes, ndim=1, dtypes=C.SIGNED_INT_DTYPES)
    C.check_tensor(fn, "sorted_index", sorted_index, ndim=1, dtypes=C.SIGNED_INT_DTYPES)
    if split_sizes.shape != sorted_index.shape:
        raise ValueError(
            f"{fn}: split_sizes and sorted_index must both be [C]; got "
            f"{tuple(split_sizes.shape)} and {tuple(sorted_index.shape)}"
        )
    C.check_same_device(fn, "inp", inp, split_sizes=split_sizes, sorted_index=sorted_index)
    if probs is not None:
        C.check_not_quantized(fn, "probs", probs)
        C.check_tensor(fn, "probs", probs, ndim=1, dtypes=C.PROBS_DTYPES)
        if probs.shape[0] != inp.shape[0]:
            raise ValueError(
                f"{fn}: probs has {probs.shape[0]} rows but inp has {inp.shape[0]}; both "
                "must be [T]"
            )
        C.check_same_device(fn, "inp", inp, probs=probs)
    if one_launch(inp, split_sizes):
        return  # the kernel checks the values itself (device asserts, no launches)
    if probs is not None:
        C.check_no_nan(fn, "probs", probs)
    if split_sizes.numel():
        c = split_sizes.numel()
        # extremes in int64: T and C would wrap in an int8 / int16 tensor's dtype
        lo, hi = torch.aminmax(split_sizes)
        lo, hi = lo.long(), hi.long()
        C.check_values(fn, lo >= 0, "split_sizes must be >= 0")
        # each size <= T first: the sum of huge sizes would wrap in int64
        C.check_values(fn, (hi <= inp.shape[0]) & (split_sizes.sum() <= inp.shape[0]),
                       "split_sizes must sum to at most T, the rows of inp")
        C.check_range(fn, sorted_index, 0, c, f"sorted_index entries must be in [0, {c})")
        ar = torch.arange(c, device=sorted_index.device)
        C.check_values(fn, (torch.sort(sorted_index).values == ar).all(),
                       f"sorted_index must be a permutation of 0..{c - 1} (each chunk once)")


@C.user_errors
def moe_sort_chunks_by_index(
    inp: torch.Tensor, split_sizes: torch.Tensor, sorted_index: torch.Tensor
) -> torch.Tensor:
    """Split ``inp`` ``[T, H]`` along dim 0 by ``split_sizes`` (``[C]`` int tensor) and
    emit the chunks in the order ``sorted_index`` (``[C]``: chunk ``sorted_index[j]``
    goes j-th). Rows past ``sum(split_sizes)`` stay in place. Returns ``[T, H]``.

    ``split_sizes`` and ``sorted_index`` are never read on the host: no sync on CUDA
    (value checks there are async device asserts). Differentiable in ``inp``.
    """
    _check("moe_sort_chunks_by_index", inp, split_sizes, sorted_index, None)
    return _sort_chunks(inp, split_sizes, sorted_index, None)[0]


@C.user_errors
def moe_sort_chunks_by_index_with_probs(
    inp: torch.Tensor, probs: torch.Tensor, split_sizes: torch.Tensor, sorted_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_sort_chunks_by_index`` that moves ``probs`` (``[T]`` float; ``[T, 1]`` is
    taken as ``[T]``, as TransformerEngine reads it) along: ``(output [T, H],
    permuted_probs [T])``. Differentiable in ``inp`` and ``probs``."""
    fn = "moe_sort_chunks_by_index_with_probs"
    if probs is None:
        raise TypeError(f"{fn}: probs is required; use moe_sort_chunks_by_index without probs")
    C.check_not_quantized(fn, "probs", probs)  # before the [T, 1] squeeze indexes it
    if isinstance(probs, torch.Tensor) and probs.dim() == 2 and probs.shape[1] == 1:
        probs = probs[:, 0]
    _check(fn, inp, split_sizes, sorted_index, probs)
    return _sort_chunks(inp, split_sizes, sorted_index, probs)

"""``moe_sort_chunks_by_index``: reorder row chunks (``qmoe::sort_chunks``).

Used after an expert-parallel all-to-all to regroup the received chunks by local expert.
Glossary: T rows, H hidden, C chunks.
"""

from __future__ import annotations

import torch

from qmoe._intmath import cdiv, next_pow2
from qmoe._library import define
from qmoe.ops import checks as C
from qmoe.ops.backend import assert_options, gather_rows, unit_stride
from qmoe.ops.tuning import (
    MAX_KERNEL_CHUNKS,
    SIDE_WIDE_MAX_COLS,
    SORT_CHUNKS_WARPS,
    sort_chunks_tile,
)


def one_launch(inp: torch.Tensor, split_sizes: torch.Tensor) -> bool:
    """Whether the sort of ``inp`` takes ``sort_chunks_triton`` (CUDA, at most
    ``MAX_KERNEL_CHUNKS`` chunks), which also checks the sizes, the order and the probs."""
    return inp.is_cuda and split_sizes.numel() <= MAX_KERNEL_CHUNKS


def sort_chunks_triton(
    inp: torch.Tensor,
    split_sizes: torch.Tensor,
    sorted_index: torch.Tensor,
    probs: torch.Tensor | None = None,
    side: torch.Tensor | None = None,
    *,
    inverse: bool = False,
    check: bool = True,
    steps: int | None = None,
    block_h: int | None = None,
    num_warps: int = SORT_CHUNKS_WARPS,
    max_scan: int | None = None,
    words: bool = True,
    side_wide: bool | None = None,
    side_words: bool = True,
    out: torch.Tensor | None = None,
    side_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H], probs moved alike [T] or empty)``: the chunk sort of ``inp [T, H]``
    in one launch (CUDA, or CPU under TRITON_INTERPRET=1): the op's CUDA path up to
    ``MAX_KERNEL_CHUNKS`` chunks, forward and backward. Every program holds the C sizes
    and the order in registers.
    ``inverse``: the movement back (the backward; assumes a valid order). ``check``:
    program 0 asserts on the device that the sizes are >= 0 and sum to at most T and that
    the order is a permutation; moved probs must not be NaN. No host sync.

    Tiles: ``tuning.sort_chunks_tile`` (``block_h``, ``steps`` and ``max_scan`` override
    it) and ``SORT_CHUNKS_WARPS`` (``num_warps``), all overridable for the sweep. Byte rows
    (FP8 bits, e8m0 scales): ``words`` moves them as int32 words where the layout allows;
    ``sweep sort_chunks --fp8`` (docs/benchmarks.md, "FP8 rows: int32 words, the scan
    cut, side rows"), % of copy: words against bytes, dsv3 blockwise 90.4 vs 72.2, qwen3,
    mixtral and gptoss within about a point. ``out`` (tests: poisoned) receives the rows.
    ``side`` ``[T, NS]`` (the block scales of quantized rows) moves alike into ``side_out``
    (given by the caller) in the same launch (``qmoe::sort_chunks_rows``); ``side_wide``
    (default: tiles of at most ``SIDE_WIDE_MAX_COLS`` columns; always ``block_h >= NS``)
    shapes its tiles as the rows'; ``side_words`` moves byte side rows (e8m0 scales) as
    int32 words where their layout allows (same section: qwen3next MX 88.7% of copy in
    words against 73.6 in bytes; dsv3, mixtral and gptoss within half a point)."""
    from qmoe.ops._kernels.sort_chunks import sort_chunks_kernel

    t, h = inp.shape
    c = split_sizes.numel()
    if (side is None) != (side_out is None):
        raise ValueError("sort_chunks_triton: pass side and side_out together")
    for name, x in (("out", out), ("side_out", side_out)):
        if x is not None and not x.is_contiguous():
            raise ValueError(f"sort_chunks_triton: {name} must be contiguous (the kernel "
                             "writes rows at a stride of their width); pass a fresh tensor")
    out = inp.new_empty((t, h)) if out is None else out
    pp = probs.new_empty((t,)) if probs is not None else inp.new_empty(0)
    if c == 0:  # no chunks: every row stays
        out.copy_(inp)
        if side is not None:
            side_out.copy_(side)
        return out, pp.copy_(probs) if probs is not None else pp
    # the kernel steps columns, probs and the chunk tables by 1 (rows by their stride)
    inp, probs = unit_stride(inp), unit_stride(probs)
    split_sizes, sorted_index = split_sizes.contiguous(), sorted_index.contiguous()
    views = _int32_views(inp, out) if words else None  # byte rows: 4 bytes a lane
    words = views is not None
    src, dst = views or (inp, out)
    hw = src.shape[1]
    br, bh, steps = sort_chunks_tile(t, hw, src.element_size(), c, words, block_h=block_h,
                                     steps=steps, max_scan=max_scan)
    block_c = next_pow2(c)
    has_s = side is not None
    side = unit_stride(side)
    if has_s and side_words:  # (views of the caller's side_out: written in place)
        side, side_out = _int32_views(side, side_out) or (side, side_out)
    ns = side.shape[1] if has_s else 0
    if side_wide is None:
        side_wide = bh <= SIDE_WIDE_MAX_COLS
    sort_chunks_kernel[(max(1, cdiv(t, br * steps)), cdiv(max(hw, 1), bh))](
        src, dst, split_sizes, sorted_index, probs, pp if probs is not None else None, side,
        side_out if has_s else None, t, hw, c, ns, src.stride(0),
        side.stride(0) if has_s else None, INVERSE=inverse, CHECK=check,
        HAS_P=probs is not None, HAS_SIDE=has_s, BLOCK_C=block_c, BLOCK_R=br, BLOCK_H=bh,
        BLOCK_S=next_pow2(max(ns, 1)), SIDE_WIDE=side_wide and bh >= ns, STEPS=steps,
        num_warps=num_warps,
        **assert_options(),  # check_chunks, assert_probs_not_nan
    )
    return out, pp


def _int32_views(
    a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(a, b)`` (b shaped as a) viewed as int32 words, or None unless both are 1-byte
    rows that allow it (unit column stride; width, row stride and offset multiples of 4)."""
    h = a.shape[1]
    if a.element_size() != 1 or not all(
            x.stride(1) == 1 and h % 4 == 0 and x.stride(0) % 4 == 0
            and x.storage_offset() % 4 == 0 for x in (a, b)):
        return None
    return a.view(torch.int32), b.view(torch.int32)


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
    if one_launch(inp, split_sizes):
        return sort_chunks_triton(inp, split_sizes, sorted_index, probs)
    src = chunk_source_rows(split_sizes, sorted_index, inp.shape[0])
    out = gather_rows(inp, src)
    return out, (probs.index_select(0, src) if probs is not None else inp.new_empty(0))


@_sort_chunks.register_fake
def _(inp, split_sizes, sorted_index, probs):  # outputs contiguous whatever inp's strides
    pp = probs.new_empty(probs.shape) if probs is not None else inp.new_empty(0)
    return inp.new_empty(inp.shape), pp


def _setup(ctx, inputs, output):
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
    if one_launch(grad_out, split_sizes):
        return sort_chunks_triton(grad_out, split_sizes, sorted_index, grad_probs,
                                  inverse=True, check=False)
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


@_sort_chunks_backward.register_fake
def _(grad_out, split_sizes, sorted_index, grad_probs):
    gp = grad_probs.new_empty(grad_probs.shape) if grad_probs is not None else grad_out.new_empty(0)
    return grad_out.new_empty(grad_out.shape), gp


def _moved_back(op: str):
    """The autograd rule of a movement whose gradient is the movement ``qmoe::<op>``: the
    sort's is its inverse (``sort_chunks_backward``), the inverse's is the sort. Both take
    ``(rows, split_sizes, sorted_index, probs or None)`` and give ``(rows, probs)``."""

    def backward(ctx, grad_rows, grad_probs):
        split_sizes, sorted_index = ctx.saved_tensors
        gp_in = grad_probs if ctx.has_probs else None
        gi, gp = getattr(torch.ops.qmoe, op)(grad_rows, split_sizes, sorted_index, gp_in)
        return gi, None, None, gp if gp_in is not None else None

    return backward


_sort_chunks.register_autograd(_moved_back("sort_chunks_backward"), setup_context=_setup)
_sort_chunks_backward.register_autograd(_moved_back("sort_chunks"), setup_context=_setup)


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
    if one_launch(inp, split_sizes):
        so = side.new_empty(side.shape)
        out, pp = sort_chunks_triton(inp, split_sizes, sorted_index, probs, side,
                                     side_out=so)
        return out, so, pp
    out, pp = torch.ops.qmoe.sort_chunks(inp, split_sizes, sorted_index, probs)
    return out, torch.ops.qmoe.sort_chunks(side, split_sizes, sorted_index, None)[0], pp


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
    return torch.ops.qmoe.sort_chunks(inp, split_sizes, sorted_index, None)[0]


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
    return torch.ops.qmoe.sort_chunks(inp, split_sizes, sorted_index, probs)

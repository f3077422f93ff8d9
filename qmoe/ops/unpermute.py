"""``moe_unpermute``: merge the permuted rows back into tokens (``qmoe::unpermute``)."""

from __future__ import annotations

import torch

from qmoe._library import define
from qmoe.ops import checks as C
from qmoe.ops import torch_impl
from qmoe.ops.kernels.permute import permute_rows_triton
from qmoe.ops.kernels.unpermute import (
    merge_backward_triton,
    permute_backward_triton,
    unpermute_fp8_triton,
    unpermute_rows_triton,
)
from qmoe.ops.launch import num_slots
from qmoe.tensors.base import QuantizedTensor
from qmoe.tensors.layouts import FP8_PER_TENSOR


@define("unpermute(Tensor inp, Tensor row_id_map, Tensor? merging_probs) -> Tensor")
def _unpermute(
    inp: torch.Tensor, row_id_map: torch.Tensor, merging_probs: torch.Tensor | None
) -> torch.Tensor:
    """``[T, H]``: each token's rows of ``inp [N, H]`` (times ``merging_probs [T, P]`` at
    their columns) summed in fp32, in inp's dtype. Torch (CPU); one Triton launch on
    CUDA."""
    return torch_impl.unpermute_rows(inp, row_id_map, merging_probs)


_unpermute.register_cuda(unpermute_rows_triton)


@_unpermute.register_fake
def _(inp, row_id_map, merging_probs):
    return inp.new_empty((row_id_map.shape[0], inp.shape[1]))


@define(
    "unpermute_backward(Tensor grad_out, Tensor row_id_map, Tensor? merging_probs, "
    "Tensor? fwd_inp, SymInt num_rows) -> (Tensor, Tensor)"
)
def _unpermute_backward(
    grad_out: torch.Tensor,
    row_id_map: torch.Tensor,
    merging_probs: torch.Tensor | None,
    fwd_inp: torch.Tensor | None,
    num_rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``grad_inp [N, H]`` (grad_out[t] * weight at each of t's rows, zero on rows no
    token reads) and ``grad_merging_probs [T, P]`` (``<grad_out[t], inp[row]>``,
    accumulated in fp32; in fp64, rounded once, by the C++ CPU kernel; empty without
    merging_probs or fwd_inp). Torch (CPU); ``_unpermute_backward_cuda`` on CUDA."""
    grad_inp = torch_impl.permute_rows(grad_out, row_id_map, num_rows, merging_probs)
    if merging_probs is None or fwd_inp is None:
        return grad_inp, grad_out.new_empty(0)
    gw = torch_impl.merge_weight_grad(grad_out, fwd_inp, row_id_map, merging_probs.shape[1])
    return grad_inp, gw.to(merging_probs.dtype)


@_unpermute_backward.register_cuda
def _unpermute_backward_cuda(grad_out, row_id_map, merging_probs, fwd_inp, num_rows):
    """Both gradients in one launch (``merge_backward_triton``) with the weights and the
    forward input; else the weighted scatter alone. No host sync."""
    if merging_probs is not None and fwd_inp is not None:
        return merge_backward_triton(grad_out, fwd_inp, row_id_map, merging_probs)
    grad_inp = permute_rows_triton(grad_out, row_id_map, num_rows, merging_probs)
    return grad_inp, grad_out.new_empty(0)


@_unpermute_backward.register_fake
def _(grad_out, row_id_map, merging_probs, fwd_inp, num_rows):
    gi = grad_out.new_empty((num_rows, grad_out.shape[1]))
    if merging_probs is None or fwd_inp is None:
        return gi, grad_out.new_empty(0)
    return gi, merging_probs.new_empty(merging_probs.shape)


def _setup_backward(ctx, inputs, output):
    grad_out, row_id_map, merging_probs, fwd_inp, num_rows = inputs
    ctx.num_rows = num_rows
    ctx.save_for_backward(grad_out, row_id_map, merging_probs, fwd_inp)


def _route_weights(rid: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    """``[N]`` fp32: ``w[t, c]`` at the row of each kept route (t, c), zero elsewhere.
    Plain torch (differentiable, no host sync): NaN and inf pass through, where the merge
    kernels would refuse them as weights (a device assert on CUDA)."""
    s = num_slots(rid)
    valid = torch.arange(s, device=rid.device) < rid[:, 2 * s : 2 * s + 1]
    rows = torch.where(valid, rid[:, :s], n).long()  # invalid slots: a spare row, dropped
    cols = torch.where(valid, rid[:, s : 2 * s], 0).long()
    vals = w.float().gather(1, cols)
    out = torch.zeros(n + 1, dtype=torch.float32, device=w.device)
    return out.scatter(0, rows.reshape(-1), vals.reshape(-1))[:n]


def _plain_fp32(x: torch.Tensor) -> torch.Tensor:
    return x.dequantize(torch.float32) if isinstance(x, QuantizedTensor) else x.float()


def _backward_backward(ctx, u_gi, u_gw):
    """Double backward of the merge. With ``gi[r] = w[t, c] * g[t]`` and
    ``gw[t, c] = <g[t], x[r]>`` over each kept route (t, c) -> row r:
    ``d/dg = unpermute(u_gi, w) + unpermute(x * u_gw[t, c])``, ``d/dx = u_gw[t, c] *
    g[t]`` at row r, and ``d/dw = <u_gi[r], g[t]>`` (``unpermute_backward``'s weight
    gradient with ``u_gi`` in place of ``x``). The upstream ``u_gw`` (which may hold NaN,
    e.g. under a gradient scaler) is applied per row in torch, not as merge weights. All
    differentiable again."""
    g, rid, w, x = ctx.saved_tensors
    n = ctx.num_rows
    has_gw = u_gw is not None and u_gw.numel() > 0 and w is not None and x is not None
    dg = dw = dx = None
    if u_gi is not None:
        dg = _unpermute(u_gi, rid, w)
        if w is not None and ctx.needs_input_grad[2]:
            dw = _unpermute_backward(g, rid, w, u_gi, n)[1]
    if has_gw:
        w_row = _route_weights(rid, u_gw, n)[:, None]
        merged = _unpermute(_plain_fp32(x) * w_row, rid, None).to(g.dtype)
        dg = merged if dg is None else dg + merged
        if ctx.needs_input_grad[3]:
            rows = torch.ops.qmoe.permute(g, rid, None, n)[0]
            dx = (rows.float() * w_row).to(x.dtype)
    return (None if dg is None else dg.to(g.dtype)), None, dw, dx, None


_unpermute_backward.register_autograd(_backward_backward, setup_context=_setup_backward)


def _merge_setup(ctx, inputs, output):
    inp, row_id_map, merging_probs = inputs
    ctx.num_rows = inp.shape[0]
    ctx.inp_dtype = inp.dtype
    need_w = merging_probs is not None and merging_probs.requires_grad
    ctx.save_for_backward(row_id_map, merging_probs, inp if need_w else None)


def _merge_backward(ctx, grad):
    row_id_map, merging_probs, fwd_inp = ctx.saved_tensors
    gi, gw = _unpermute_backward(
        grad.contiguous(), row_id_map, merging_probs, fwd_inp, ctx.num_rows
    )
    return gi.to(ctx.inp_dtype), None, (gw if fwd_inp is not None else None)


_unpermute.register_autograd(_merge_backward, setup_context=_merge_setup)


@C.user_errors
def moe_unpermute(
    inp: torch.Tensor,
    row_id_map: torch.Tensor,
    merging_probs: torch.Tensor | None = None,
    restore_shape: torch.Size | tuple[int, int] | None = None,
    map_type: str = "mask",
    probs: torch.Tensor | None = None,
    pad_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Merge permuted rows back into tokens: ``out[t] = sum_r inp[r] * w(t, r)``.

    Args:
        inp: ``[N, H]`` fp32/bf16/fp16, the (expert-processed) output of a permute.
        row_id_map: ``[T, 2*S + 1]`` int32 from ``moe_permute*``; T comes from it. A
            hand-made map must name each row at most once, as qmoe's do (checked on the
            CPU, with its other bounds; on CUDA the kernel checks the rows' range only).
        merging_probs: optional ``[T, E]`` (mask map) or ``[T, K]`` (index map) float
            weights (fp64 included; read as fp32); without it each kept route counts once.
            Only the weights of kept routes are read: NaN there raises (a ``ValueError``
            on CPU, a device assert on CUDA); other entries may hold anything.
        restore_shape: optional ``(T, H)``; checked against the map, never needed.
        map_type: ``"mask"`` or ``"index"``, as given to the permute (the map itself
            carries the probs columns, so this is only validated).
        probs: TransformerEngine's deprecated alias of ``merging_probs``.
        pad_offsets: accepted for TransformerEngine call compatibility and ignored: the
            map of ``moe_permute_and_pad_with_probs`` already holds padded rows (unlike
            TransformerEngine's, see docs/ops.md). Raises with ``map_type="index"``.

    Returns ``[T, H]`` in ``inp.dtype``, accumulated in fp32 (rows in ascending order).
    Dropped routes and padding rows are never read; a token with no kept route gets
    zeros. No host sync. Differentiable in ``inp`` and ``merging_probs``.
    """
    fn = "moe_unpermute"
    if probs is not None:
        if merging_probs is not None:
            raise ValueError(f"{fn}: pass merging_probs or probs (its old name), not both")
        merging_probs = probs
    C.check_input(fn, inp)
    C.check_tensor(fn, "row_id_map", row_id_map, ndim=2, dtypes=(torch.int32,),
                   fix="pass the row_id_map returned by qmoe.moe_permute*")
    if row_id_map.shape[1] % 2 != 1:
        raise ValueError(f"{fn}: row_id_map must be [T, 2*S + 1], got {tuple(row_id_map.shape)}")
    if map_type not in ("mask", "index"):
        raise ValueError(f"{fn}: map_type must be 'mask' or 'index', got {map_type!r}")
    if pad_offsets is not None and map_type == "index":
        raise ValueError(
            f"{fn}: pad_offsets goes with the mask maps of moe_permute_and_pad_with_probs "
            "(qmoe pads mask maps only, and their map already holds the padded rows); "
            "drop pad_offsets"
        )
    if merging_probs is not None:
        C.check_not_quantized(fn, "merging_probs", merging_probs)
        C.check_tensor(fn, "merging_probs", merging_probs, ndim=2, dtypes=C.PROBS_DTYPES)
    C.check_same_device(fn, "inp", inp, row_id_map=row_id_map, merging_probs=merging_probs)
    t = row_id_map.shape[0]
    if restore_shape is not None and not isinstance(restore_shape, (tuple, list, torch.Size)):
        raise TypeError(f"{fn}: restore_shape must be a (T, H) tuple or torch.Size, got "
                        f"{type(restore_shape).__name__}; omit it (qmoe recovers T from "
                        "row_id_map)")
    if restore_shape is not None and tuple(restore_shape) != (t, inp.shape[1]):
        raise ValueError(
            f"{fn}: restore_shape {tuple(restore_shape)} does not match the map's T={t} and "
            f"inp's H={inp.shape[1]}; omit it (qmoe recovers T from row_id_map)"
        )
    if merging_probs is not None:
        if merging_probs.shape[0] != t:
            raise ValueError(
                f"{fn}: merging_probs must be [T, E] or [T, K] with T={t} (the rows of "
                f"row_id_map), got {tuple(merging_probs.shape)}"
            )
        if merging_probs.shape[1] != num_slots(row_id_map):
            raise ValueError(
                f"{fn}: merging_probs has {merging_probs.shape[1]} columns but the map was "
                f"built for {num_slots(row_id_map)} (E for a mask map, K for an index map)"
            )
    # On CUDA the merge kernel itself checks the rows it reads and the weights it uses
    # (no extra pass); elsewhere, check here.
    if row_id_map.numel() and not inp.is_cuda:
        _check_map_values(fn, row_id_map, inp.shape[0], merging_probs)
    return _unpermute(inp, row_id_map, merging_probs)


def _map_errors(s: int, p: int) -> dict[int, str]:
    """``qmoe::map_check``'s codes and the messages they raise (S slots, P probs
    columns)."""
    return {
        1: f"row_id_map counts routes outside [0, {s}] (its slots); pass the row_id_map "
           "qmoe built",
        2: "row_id_map points past the rows of inp; pass the permute's output (all N rows) "
           "with the row_id_map built for it",
        3: "row_id_map names an output row twice (the backward would keep one token's "
           "gradient for it); pass the row_id_map qmoe built",
        4: f"row_id_map names probs columns outside [0, {p}); pass the row_id_map qmoe "
           "built with these merging_probs' routing",
        5: "merging_probs holds NaN at a kept route; fix the router upstream",
    }


def _check_map_values(fn: str, row_id_map: torch.Tensor, n: int,
                      merging_probs: torch.Tensor | None) -> None:
    """The map's values as the merge reads them: each route count in ``[0, S]``, each
    kept route's row in ``[0, N)`` and named once, its probs column inside
    ``merging_probs``, and its weight not NaN. Only kept routes are read: the other
    entries of ``merging_probs`` may hold anything (TransformerEngine's tests give
    unrouted tokens 0/0 = NaN). Eager: one ``qmoe::map_check`` (a C++ pass on CPU) and a
    ``ValueError``; under compile, async asserts in the graph."""
    s = num_slots(row_id_map)
    if s == 0:
        return
    p = merging_probs.shape[1] if merging_probs is not None else 0
    if not C.is_compiling():
        code = int(_map_check(row_id_map, n, merging_probs))
        if code:
            raise ValueError(f"{fn}: {_map_errors(s, p)[code]}")
        return
    for code, cond in _map_conditions(row_id_map, n, merging_probs):
        C.check_values(fn, cond, _map_errors(s, p)[code])


def _map_conditions(row_id_map: torch.Tensor, n: int, merging_probs: torch.Tensor | None):
    """``(code, 0-d bool tensor: that check passes)`` for each of ``map_check``'s checks
    in order, computed lazily (torch ops; each assumes the ones before it held)."""
    s = num_slots(row_id_map)
    count = row_id_map[:, 2 * s]
    if count.numel():
        cmin, cmax = torch.aminmax(count)
        yield 1, (cmin >= 0) & (cmax <= s)
    kept = torch.arange(s, device=row_id_map.device) < count[:, None]
    rows = row_id_map[:, :s]
    yield 2, ~(kept & ((rows < 0) | (rows >= n))).any()
    yield 3, _rows_named_once(row_id_map, n)
    if merging_probs is None:
        return
    cols = row_id_map[:, s : 2 * s]
    p = merging_probs.shape[1]
    yield 4, ~(kept & ((cols < 0) | (cols >= p))).any()
    w = merging_probs.gather(1, torch.where(kept & (cols >= 0) & (cols < p), cols, 0).long())
    yield 5, ~(kept & w.isnan()).any()


@define("map_check(Tensor row_id_map, SymInt num_rows, Tensor? merging_probs) -> Tensor")
def _map_check(row_id_map: torch.Tensor, num_rows: int,
               merging_probs: torch.Tensor | None) -> torch.Tensor:
    """int32 0-d: the first thing wrong with ``row_id_map [T, 2S+1]`` as a merge of
    ``num_rows`` rows (weighted by ``merging_probs [T, P]``) reads it, 0 if nothing
    (codes: ``_map_errors``). Torch (this; any device); ``qmoe._C`` has a C++ pass for
    CPU. The caller reads the code: a host sync."""
    if num_slots(row_id_map) == 0:
        return row_id_map.new_zeros(())
    for code, cond in _map_conditions(row_id_map, num_rows, merging_probs):
        if not bool(cond):
            return row_id_map.new_full((), code)
    return row_id_map.new_zeros(())


@_map_check.register_fake
def _(row_id_map, num_rows, merging_probs):
    return row_id_map.new_empty(())


def _rows_named_once(row_id_map: torch.Tensor, n: int) -> torch.Tensor:
    """0-d bool: no output row in ``[0, n)`` is named by two kept routes of the map (qmoe's
    maps never do; a hand-made one could). One scatter-add over the slots. CPU tensors in
    eager mode (``qmoe::map_check``'s torch kernel) read the largest count first, which is
    free there, and look at that many slots (K of a mask map's E: 30x less work at
    E = 256); under compile all S slots, with static shapes."""
    s = num_slots(row_id_map)
    count = row_id_map[:, 2 * s :]
    if row_id_map.device.type == "cpu" and not C.is_compiling() and count.numel():
        s = max(0, min(s, int(count.max())))
    rows = row_id_map[:, :s]
    kept = torch.arange(s, device=rows.device) < count  # the first count slots
    idx = torch.where(kept & (rows >= 0), rows, n).long().clamp(0, n).flatten()
    hits = torch.zeros(n + 1, dtype=torch.int32, device=rows.device)
    hits.scatter_add_(0, idx, torch.ones_like(idx, dtype=torch.int32))
    return (hits[:n] <= 1).all()


@define(
    "unpermute_fp8(Tensor qbits, Tensor scale, Tensor row_id_map, Tensor? merging_probs, "
    "int layout, int block_size, ScalarType fp8_dtype, ScalarType out_dtype) -> Tensor"
)
def _unpermute_fp8(qbits, scale, row_id_map, merging_probs, layout, block_size, fp8_dtype,
                   out_dtype):
    """``[T, H]`` in ``out_dtype``: the merge of quantized rows ``qbits [N, H]`` (uint8 fp8
    bits; ``scale`` in ``layout``), each dequantized and summed in fp32. Torch (CPU); one
    Triton launch on CUDA, the rows dequantized inside the merge kernel."""
    _check_fp8_scale(qbits, scale, layout, block_size)
    return torch_impl.unpermute_fp8_rows(qbits, scale, layout, block_size, fp8_dtype,
                                         row_id_map, merging_probs, out_dtype)


@_unpermute_fp8.register_cuda
def _unpermute_fp8_cuda(qbits, scale, row_id_map, merging_probs, layout, block_size,
                        fp8_dtype, out_dtype):
    _check_fp8_scale(qbits, scale, layout, block_size)
    return unpermute_fp8_triton(qbits, scale, layout, block_size, fp8_dtype, row_id_map,
                                merging_probs, out_dtype)


def _check_fp8_scale(qbits, scale, layout, block_size) -> None:
    if layout != FP8_PER_TENSOR:  # the kernels index scale rows by block (metadata check)
        nb = -(-qbits.shape[1] // max(block_size, 1))
        if block_size < 1 or scale.dim() != 2 or tuple(scale.shape) != (qbits.shape[0], nb):
            raise ValueError(
                f"qmoe::unpermute_fp8: block scales must be [N, ceil(H / block_size)] = "
                f"[{qbits.shape[0]}, {nb}], got {tuple(scale.shape)} (block_size {block_size})"
            )


@_unpermute_fp8.register_fake
def _(qbits, scale, row_id_map, merging_probs, layout, block_size, fp8_dtype, out_dtype):
    return qbits.new_empty((row_id_map.shape[0], qbits.shape[1]), dtype=out_dtype)


def probs_grad(rid: torch.Tensor, grad_probs: torch.Tensor, t: int, p: int, dtype):
    """``[T, P]`` gradient of the probs from that of ``permuted_probs`` ``[N]``: each kept
    route's (its first ``count`` slots) ``grad_probs[row]`` at its column, zeros elsewhere.
    Torch."""
    s = num_slots(rid)
    kept = torch.arange(s, device=rid.device) < rid[:, 2 * s : 2 * s + 1]
    dst = torch.where(kept, rid[:, :s], 0).long()
    vals = torch.where(kept, grad_probs[dst] if grad_probs.numel() else 0, 0)
    gp = torch.zeros(t, p + 1, dtype=dtype, device=rid.device)
    cols = torch.where(kept, rid[:, s : 2 * s], p).long()  # other slots: a scratch column
    gp.scatter_(1, cols, vals.to(dtype))
    return gp[:, :p].contiguous()  # (qmoe::permute_backward's output: contiguous)


@define(
    "permute_backward(Tensor grad_out, Tensor row_id_map, Tensor grad_probs, int num_cols, "
    "ScalarType probs_dtype) -> (Tensor, Tensor)"
)
def _permute_backward_op(grad_out, row_id_map, grad_probs, num_cols, probs_dtype):
    """The backward of a permute with probs: ``(grad_inp [T, H]``, each token's rows of
    ``grad_out [N, H]`` summed in fp32 in grad_out's dtype; ``grad_probs_in [T, num_cols]``
    in ``probs_dtype``, ``grad_probs [N]`` at each kept route's column, zeros
    elsewhere)``. Torch (the merge op, then ``probs_grad``); one Triton launch on CUDA; a
    C++ pass on CPU with ``qmoe._C``."""
    gi = _unpermute(grad_out, row_id_map, None)
    return gi, probs_grad(row_id_map, grad_probs, row_id_map.shape[0], num_cols, probs_dtype)


_permute_backward_op.register_cuda(permute_backward_triton)


@_permute_backward_op.register_fake
def _(grad_out, row_id_map, grad_probs, num_cols, probs_dtype):
    t = row_id_map.shape[0]
    return (grad_out.new_empty((t, grad_out.shape[1])),
            grad_out.new_empty((t, num_cols), dtype=probs_dtype))


def _permute_backward_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])
    ctx.num_rows, ctx.h = inputs[0].shape
    ctx.dtype = inputs[0].dtype


def _permute_backward_backward(ctx, u_gi, u_gp):
    """Both outputs are linear in the inputs: ``grad_inp`` sums rows (its adjoint moves
    ``u_gi`` to the rows), ``grad_probs_in`` moves ``grad_probs`` to columns (its adjoint
    moves ``u_gp`` back to the rows): one permute of ``u_gi`` with ``u_gp`` as its probs."""
    (rid,) = ctx.saved_tensors
    n = ctx.num_rows
    t = rid.shape[0]
    if u_gi is None:
        u_gi = rid.new_zeros((t, ctx.h), dtype=ctx.dtype)
    if u_gp is None:
        d_out, _ = torch.ops.qmoe.permute(u_gi, rid, None, n)
        return d_out, None, None, None, None
    d_out, d_probs = torch.ops.qmoe.permute(u_gi, rid, u_gp, n)
    return d_out, None, d_probs, None, None


_permute_backward_op.register_autograd(_permute_backward_backward,
                                       setup_context=_permute_backward_setup)


def permute_grads(rid, grad_out, grad_probs, probs_meta):
    """``(grad of inp [T, H], grad of probs [T, P] or None)`` of a permute by ``rid`` (the
    merge of the rows' gradient: every permute's backward, fused or not; with the probs'
    gradient, one ``qmoe::permute_backward``); ``probs_meta``: ``(probs shape, dtype)``, or
    None without probs. ``grad_out`` / ``grad_probs`` may be None (an output unused): the
    permute setups turn off autograd's zero-filled gradients, which cost a fill launch each
    (the routing map's included)."""
    has_gp = probs_meta is not None and grad_probs is not None
    if grad_out is None:  # (setups turn off materialized zero gradients: only probs used)
        if not has_gp:
            return None, None
        (t, p), dtype = probs_meta
        return None, probs_grad(rid, grad_probs, t, p, dtype)
    if has_gp:
        (_, p), dtype = probs_meta
        return _permute_backward_op(grad_out.contiguous(), rid, grad_probs, p, dtype)
    return _unpermute(grad_out.contiguous(), rid, None), None

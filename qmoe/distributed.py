"""Expert-parallel token dispatch over ``torch.distributed`` (NCCL on GPUs, Gloo on CPU).

Glossary: T local tokens, H hidden, W ranks, L experts per rank, E = W * L global
experts (expert ``e`` lives on rank ``e // L``), R rows received by a rank.

``dispatch`` follows the Megatron / torchtitan pattern:

1. ``moe_permute`` groups the local tokens by global expert (so by destination rank);
2. the ``[E]`` per-expert counts are exchanged with ``all_to_all_single``;
3. the rows travel with ``all_to_all_single`` (uneven splits, or C rows per rank pair);
4. ``moe_sort_chunks_by_index`` regroups the received chunks by local expert.

``combine`` runs it backwards: sort back, all-to-all back, ``moe_unpermute`` with the
router probs as merging probs. FP8 inputs (``qmoe.quantize`` output) travel quantized
through the op ``qmoe::all_to_all_rows``, whose passthrough rule sends ``qdata`` bits and
block-scale rows as their own tensors and rewraps them on arrival (about half the bytes of
bf16). Per-tensor scales differ between ranks, so rank j
rescales its rows by ``s_j / max(s)`` before sending (one fp8 rounding; bit-exact when all
scales are equal, e.g. with a globally agreed scale). Autograd runs through the whole path: the
backward of an all-to-all is the reverse all-to-all, on high-precision gradients.

Host syncs: the default path reads the split sizes on the host once per ``dispatch``
(one ``.tolist()`` of the exchanged counts; ``combine`` reuses them). With
``capacity=C`` nothing is read on the host: every rank sends exactly C rows to every
rank (zero rows pad, rows past C are dropped and merge as zero), so the splits are static
and the whole path can be captured in a CUDA graph. That form compiles with
``torch.compile(fullgraph=True)``, bf16 and FP8 alike (docs/distributed.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from qmoe._library import define
from qmoe.ops import moe_permute, moe_sort_chunks_by_index, moe_unpermute
from qmoe.ops.checks import (
    ID_LIMIT,
    MASK_FROM_IDS,
    check_mask_values,
    check_range,
    check_values,
)
from qmoe.ops.launch import num_slots
from qmoe.ops.quantize_permute import quantize_permute_by_map
from qmoe.ops.row_id_map import compact_routes
from qmoe.tensors.base import QuantizedTensor, register_passthrough
from qmoe.tensors.recipes import MXFP8, Blockwise, PerTensor, Recipe, RowWise

__all__ = ["dispatch", "combine", "DispatchHandle", "TokenDispatcher", "wire_bytes_per_row"]

_c10d = torch.ops._c10d_functional  # functional collectives (traced by torch.compile)


# ----------------------------------------------------------------- all-to-all
def _a2a_functional(t: torch.Tensor, out_splits, in_splits, group_name: str) -> torch.Tensor:
    """All-to-all of rows through the functional collectives (the ops Dynamo turns
    ``dist.all_to_all_single`` into): traced under ``torch.compile``, run in eager."""
    out = _c10d.all_to_all_single(t.contiguous(), out_splits, in_splits, group_name)
    return _c10d.wait_tensor(out)


@define(
    "all_to_all_rows(Tensor x, SymInt[] out_splits, SymInt[] in_splits, str group_name) "
    "-> Tensor"
)
def _all_to_all_rows(x, out_splits, in_splits, group_name):
    """All-to-all of the rows of ``x`` (differentiable: the backward is the reverse
    all-to-all). The op quantized rows take: its passthrough rule below moves them as fp8
    bits plus scales, so Dynamo keeps the quantized tensor at this call and AOTAutograd
    desugars it through the rule (docs/design.md), as for the permutation ops."""
    return _a2a_functional(x, out_splits, in_splits, group_name)


@_all_to_all_rows.register_fake
def _(x, out_splits, in_splits, group_name):
    return x.new_empty((sum(out_splits), *x.shape[1:]))


def _a2a_rows_setup(ctx, inputs, output):
    ctx.splits = inputs[1:]


def _a2a_rows_backward(ctx, grad):
    out_splits, in_splits, group_name = ctx.splits
    if isinstance(grad, QuantizedTensor):
        grad = grad._dequantize_raw()
    return _a2a_functional(grad, in_splits, out_splits, group_name), None, None, None


_all_to_all_rows.register_autograd(_a2a_rows_backward, setup_context=_a2a_rows_setup)


def _a2a_rows_args(x, out_splits, in_splits, group_name):
    return x, out_splits, in_splits, group_name


@register_passthrough(torch.ops.qmoe.all_to_all_rows.default)
def _a2a_quantized(func, args, kwargs):
    """Quantized rows travel as fp8 bits plus scale rows, rewrapped on arrival."""
    x, out_splits, in_splits, group_name = _a2a_rows_args(*args, **kwargs)
    if x.block_size is not None:
        bits = _a2a_functional(x.qdata.view(torch.uint8), out_splits, in_splits, group_name)
        scale = _a2a_functional(x.raw_scale, out_splits, in_splits, group_name)
        return x._rewrap(bits.view(x.fp8_dtype), scale)
    # Per-tensor: one scale per sender. Every sender brings its rows to the largest scale
    # before sending (one fp8 rounding), so the receiver needs no per-row sender index:
    # nothing is read on the host and the capacity path stays capturable.
    world = len(out_splits)
    s = x.raw_scale.reshape(1).contiguous()
    s_max = _c10d.wait_tensor(_c10d.all_gather_into_tensor(s, world, group_name)).amax()
    q = (x.qdata.float() * (x.raw_scale.reshape(()) / s_max)).to(x.fp8_dtype)
    bits = _a2a_functional(q.view(torch.uint8), out_splits, in_splits, group_name)
    return x._rewrap(bits.view(x.fp8_dtype), s_max)


def _all_to_all(x: torch.Tensor, out_splits, in_splits, group) -> torch.Tensor:
    """Differentiable all-to-all of rows, plain or quantized, through
    ``qmoe::all_to_all_rows``. Plain rows take the op too: an ``autograd.Function`` around
    ``dist.all_to_all_single`` loses its input's gradient under ``torch.compile`` on torch
    2.11 (zero gradient, no error), and quantized rows must not meet Python code of their
    class inside a compiled region (Dynamo sees a quantized tensor made there as a plain
    tensor variable whose properties and methods it does not run)."""
    name = (dist.group.WORLD if group is None else group).group_name
    return torch.ops.qmoe.all_to_all_rows(x, out_splits, in_splits, name)


def _counts_a2a(counts: torch.Tensor, group) -> torch.Tensor:
    """Exchange ``[E]`` per-expert counts: returns ``[W*L]``, (source rank, local expert)."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


# ------------------------------------------------------------------- handle
@dataclass
class DispatchHandle:
    """What ``combine`` needs from ``dispatch`` (all on the tokens' device)."""

    row_id_map: torch.Tensor  # (T, 2E+1) int32: where each token's rows went
    probs: torch.Tensor | None  # (T, E) merging probs, or None
    grouped_sizes: torch.Tensor  # sizes of the chunks in the grouped (by local expert) order
    back_index: torch.Tensor  # chunk order that undoes the grouping
    send_splits: list[int]  # rows sent to each rank (received back in combine)
    recv_splits: list[int]  # rows received from each rank
    group: object
    num_rows: int  # rows of the permuted buffer before the all-to-all


def _group_order(world: int, local: int, device, pad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk orders: (grouping, inverse). Chunks arrive as (rank j, local expert l) with
    ``pad`` adding one trailing chunk per rank; grouped order is l-major, pads last."""
    per = local + (1 if pad else 0)
    j = torch.arange(world, device=device)
    l_ = torch.arange(local, device=device)
    order = (j[None, :] * per + l_[:, None]).reshape(-1)  # (l, j) -> arrival chunk id
    if pad:
        order = torch.cat([order, j * per + local])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=device)
    return order, inverse


def dispatch(
    x: torch.Tensor,
    probs: torch.Tensor | None,
    routing_map: torch.Tensor,
    num_local_experts: int,
    group=None,
    *,
    capacity: int | None = None,
    quantize: Recipe | None = None,
    map_type: str = "mask",
) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
    """Send each token's rows to the ranks that own its experts.

    Args:
        x: ``[T, H]`` high precision, or a qmoe FP8 tensor (travels quantized).
        probs: router probs used as merging probs in ``combine`` (or None): ``[T, E]``
            with a mask, ``[T, K]`` (one per id) with an index map.
        routing_map: ``map_type="mask"``: ``[T, E]`` bool, or integer holding only 0 and
            1 (other values raise), over the E = W * L global experts.
            ``map_type="index"``: ``[T, K]`` integer expert ids in ``[-1, E)``, ``-1`` =
            no route, no id twice in a token (checked: a ``ValueError`` on CPU, an async
            device assert on CUDA); turned into the mask (and ``[T, E]`` probs) first.
        num_local_experts: L.
        capacity: rows each rank sends to each rank; ``None`` sends exactly the routed
            rows (one host sync for the split sizes), an int is sync-free (padded with
            zero rows; rows past it are dropped).
        quantize: a recipe (``qmoe.RowWise()``, ...) to quantize high-precision ``x`` in
            the permute's pass (the fused ``quantize=`` of ``moe_permute``): the rows are
            read once and sent as FP8, bit for bit ``dispatch(qmoe.quantize(x, recipe),
            ...)``.
        map_type: ``"mask"`` or ``"index"``.

    Returns ``(expert_input [R, H], tokens_per_local_expert [L] int64, handle)``:
    ``expert_input`` holds local expert 0's rows, then expert 1's, ... (with ``capacity``,
    zero padding rows follow them); it has ``x``'s type (the recipe's with ``quantize``).
    """
    if map_type not in ("mask", "index"):
        raise ValueError(f"dispatch: map_type must be 'mask' or 'index', got {map_type!r}")
    if map_type == "index":  # (the ids' form is checked before the group is asked for E)
        _check_ids_form(routing_map, probs)
        e = dist.get_world_size(group) * num_local_experts
        routing_map, probs = _mask_from_ids(routing_map, probs, e)
    if routing_map.dim() != 2:
        raise ValueError(f"dispatch: routing_map must be [T, E], got {tuple(routing_map.shape)}")
    check_mask_values("dispatch", routing_map, MASK_FROM_IDS)
    world = dist.get_world_size(group)
    e = routing_map.shape[1]
    if num_local_experts < 1 or e != world * num_local_experts:
        raise ValueError(
            f"dispatch: routing_map has E={e} experts but world_size={world} x "
            f"num_local_experts={num_local_experts} = {world * num_local_experts}"
        )
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)
                                 or capacity < 0):
        raise ValueError(f"dispatch: capacity must be a non-negative int, got {capacity!r}")
    if quantize is not None and not isinstance(quantize, (PerTensor, Blockwise, RowWise, MXFP8)):
        raise TypeError("dispatch: quantize must be None or qmoe.PerTensor(), qmoe.Blockwise(), "
                        f"qmoe.RowWise() or qmoe.MXFP8(), got {quantize!r}")
    if quantize is not None and isinstance(x, QuantizedTensor):
        raise TypeError(f"dispatch: x is already quantized ({type(x).__name__}); pass it "
                        "without quantize=, or pass the high-precision tokens")
    dev = x.device
    mask = routing_map != 0
    counts = mask.sum(0)  # (E,) int64
    if capacity is None:
        recv_counts = _counts_a2a(counts, group)
        host = torch.cat([counts, recv_counts]).tolist()  # the one host sync
        send_splits = [sum(host[j * num_local_experts:(j + 1) * num_local_experts])
                       for j in range(world)]
        recv = host[e:]
        recv_splits = [sum(recv[j * num_local_experts:(j + 1) * num_local_experts])
                       for j in range(world)]
        n = sum(send_splits)
        out, rid = moe_permute(x, mask, n, quantize=quantize)
        sizes = recv_counts
        order, inverse = _group_order(world, num_local_experts, dev, pad=False)
    else:
        c = capacity
        rid = _capacity_map(mask, counts, world, num_local_experts, c)
        n = world * c
        if quantize is None:
            out, _ = torch.ops.qmoe.permute(x, rid, None, n)
        else:
            out = quantize_permute_by_map(x, rid, n, quantize)
        kept = _kept_counts(counts, world, num_local_experts, c)
        recv_kept = _counts_a2a(kept, group).view(world, num_local_experts)
        pads = c - recv_kept.sum(1, keepdim=True)
        sizes = torch.cat([recv_kept, pads], dim=1).reshape(-1)
        send_splits = recv_splits = [c] * world
        order, inverse = _group_order(world, num_local_experts, dev, pad=True)
        recv_counts = recv_kept.reshape(-1)
    received = _all_to_all(out, recv_splits, send_splits, group)
    grouped = moe_sort_chunks_by_index(received, sizes, order)
    tokens_per_local_expert = recv_counts.view(world, num_local_experts).sum(0)
    handle = DispatchHandle(
        row_id_map=rid, probs=probs, grouped_sizes=sizes[order], back_index=inverse,
        send_splits=send_splits, recv_splits=recv_splits, group=group, num_rows=n,
    )
    return grouped, tokens_per_local_expert, handle


def _check_ids_form(ids, probs) -> None:
    """An index map's form: ``[T, K]`` integer ids, ``[T, K]`` probs (or None)."""
    fn = "dispatch"
    if (not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point
            or ids.dtype == torch.bool):
        raise TypeError(f"{fn}: with map_type='index' routing_map must be [T, K] integer "
                        f"expert ids, got {getattr(ids, 'dtype', type(ids).__name__)} "
                        f"{tuple(getattr(ids, 'shape', ()))}")
    if probs is not None and tuple(probs.shape) != tuple(ids.shape):
        raise ValueError(f"{fn}: with map_type='index' probs must be [T, K] = "
                         f"{list(ids.shape)} (one per id), got {list(probs.shape)}")


def _mask_from_ids(ids, probs, e: int):
    """``[T, K]`` expert ids (and ``[T, K]`` probs) as the ``[T, E]`` mask (and probs)
    dispatch moves by: a scatter into E + 1 columns, the last one taking the ``-1``s.
    Differentiable in ``probs``. No host sync on CUDA."""
    fn = "dispatch"
    check_range(fn, ids, -1, e, f"routing_map ids must be >= -1 and < E={e} (world size "
                "x num_local_experts)")
    t = ids.shape[0]
    col = torch.where(ids >= 0, ids, e).long()
    mask = torch.zeros(t, e + 1, dtype=torch.bool, device=ids.device).scatter_(1, col, True)
    mask = mask[:, :e]
    check_values(fn, (mask.sum(1) == (ids >= 0).sum(1)).all(),
                 "routing_map names an expert twice in a token; each id once per token")
    if probs is not None:
        probs = probs.new_zeros(t, e + 1).scatter(1, col, probs)[:, :e]
    return mask, probs


def combine(expert_output: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Bring the expert outputs home and merge them: ``[T, H]``, weighted by the router
    probs given to ``dispatch`` (fp32 accumulation). No host sync."""
    h = handle
    rows = sum(h.recv_splits)  # the rows dispatch returned on this rank
    if expert_output.dim() != 2 or expert_output.shape[0] != rows:
        raise ValueError(f"combine: expert_output must be [{rows}, H] (one row per row "
                         f"dispatch returned), got {tuple(expert_output.shape)}")
    back = moe_sort_chunks_by_index(expert_output, h.grouped_sizes, h.back_index)
    home = _all_to_all(back, h.send_splits, h.recv_splits, h.group)
    return moe_unpermute(home, h.row_id_map, h.probs)


def _kept_counts(counts: torch.Tensor, world: int, local: int, c: int) -> torch.Tensor:
    """Per expert, how many of its rows fit in the C rows sent to its rank."""
    per_rank = counts.view(world, local)
    before = torch.cumsum(per_rank, 1) - per_rank
    return (c - before).clamp(min=0).minimum(per_rank).reshape(-1)


def _capacity_map(mask, counts, world: int, local: int, c: int) -> torch.Tensor:
    """row_id_map whose rows are ``rank * C + position within the rank's rows``; routes
    past position C are dropped. Device ops only."""
    t, e = mask.shape
    # every route (T*E bounds them; rows are int32, so at most 2**31 - 1)
    rid, _ = torch.ops.qmoe.make_row_id_map(mask, min(t * e, ID_LIMIT), False, 1)
    s = num_slots(rid)
    dst, col = rid[:, :s].long(), rid[:, s : 2 * s].long()
    start = torch.cumsum(counts, 0) - counts  # first row of each expert
    rank_start = start.view(world, local)[:, 0]
    j = torch.where(col >= 0, col, 0) // local
    rel = dst - rank_start[j]
    keep = (dst >= 0) & (rel < c)
    new = torch.where(keep, j * c + rel, -1).to(torch.int32)
    return compact_routes(new, torch.where(keep, col, -1).to(torch.int32))


def wire_bytes_per_row(x: torch.Tensor) -> int:
    """Bytes one row costs on the wire: H * elem, or fp8 bits plus its scale row."""
    h = x.shape[-1]
    if isinstance(x, QuantizedTensor):
        scale = x.raw_scale
        per_row_scale = 0 if x.block_size is None else scale.shape[-1] * scale.element_size()
        return h + per_row_scale
    return h * x.element_size()


class TokenDispatcher(torch.nn.Module):
    """Module form: ``expert_in, tokens_per_expert = d.dispatch(x, probs, routing_map)``,
    then ``y = d.combine(expert_out)``. Holds the last dispatch's handle between the two
    calls (per instance; use one instance per in-flight micro-batch)."""

    def __init__(self, num_local_experts: int, group=None, capacity: int | None = None,
                 quantize: Recipe | None = None):
        super().__init__()
        self.num_local_experts = num_local_experts
        self.group = group
        self.capacity = capacity
        self.quantize = quantize
        self._handle: DispatchHandle | None = None

    def dispatch(self, x, probs, routing_map):
        out, tpe, self._handle = dispatch(
            x, probs, routing_map, self.num_local_experts, self.group, capacity=self.capacity,
            quantize=self.quantize,
        )
        return out, tpe

    def combine(self, expert_output):
        if self._handle is None:
            raise RuntimeError("TokenDispatcher.combine called before dispatch")
        handle, self._handle = self._handle, None
        return combine(expert_output, handle)

"""``moe_permute`` and friends: group token rows by expert (``qmoe::permute``).

Glossary: T tokens, E experts, K top-k slots, H hidden, N output rows.
"""

from __future__ import annotations

import torch

from qmoe._library import define
from qmoe.ops import checks as C
from qmoe.ops import torch_impl
from qmoe.ops.kernels.permute import permute_rows_triton
from qmoe.ops.permute_index import _permute_index
from qmoe.ops.permute_mask import _permute_mask
from qmoe.ops.quantize_permute import quantize_and_permute
from qmoe.ops.row_id_map import make_row_id_map
from qmoe.ops.tuning import fused_index_wins, small_index_map
from qmoe.ops.unpermute import permute_grads
from qmoe.tensors.recipes import Recipe

__all__ = ["moe_permute", "moe_permute_with_probs", "moe_permute_and_pad_with_probs"]


@define(
    "permute(Tensor inp, Tensor row_id_map, Tensor? probs, SymInt num_out_tokens, "
    "Tensor? fill=None) -> (Tensor, Tensor)"
)
def _permute(
    inp: torch.Tensor,
    row_id_map: torch.Tensor,
    probs: torch.Tensor | None,
    num_out_tokens: int,
    fill: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [N, H], permuted_probs [N] or empty)``: ``inp [T, H]`` and ``probs [T, P]``
    moved to the rows of ``row_id_map``. ``fill``: the map's unwritten row ranges from
    ``make_row_id_map`` (zeroed in the scatter launch on CUDA), or None. Torch (CPU);
    ``_permute_cuda`` on CUDA."""
    pp = probs.new_empty((num_out_tokens,)) if probs is not None else inp.new_empty(0)
    out = torch_impl.permute_rows(inp, row_id_map, num_out_tokens, probs=probs, probs_out=pp)
    return out, pp


@_permute.register_cuda
def _permute_cuda(inp, row_id_map, probs, num_out_tokens, fill=None):
    """One scatter launch (rows, probs and the unwritten rows' zeros). No host sync."""
    pp = probs.new_empty((num_out_tokens,)) if probs is not None else inp.new_empty(0)
    out = permute_rows_triton(inp, row_id_map, num_out_tokens, probs=probs,
                              probs_out=pp if probs is not None else None, fill=fill)
    return out, pp


@_permute.register_fake
def _(inp, row_id_map, probs, num_out_tokens, fill=None):
    out = inp.new_empty((num_out_tokens, inp.shape[1]))
    if probs is None:
        return out, inp.new_empty(0)
    return out, probs.new_empty((num_out_tokens,))


def _permute_setup(ctx, inputs, output):
    inp, row_id_map, probs = inputs[:3]
    ctx.set_materialize_grads(False)  # (permute_grads takes None for an unused output)
    ctx.save_for_backward(row_id_map)
    ctx.probs_meta = None if probs is None else (tuple(probs.shape), probs.dtype)


def _permute_backward(ctx, grad_out, grad_probs):
    (rid,) = ctx.saved_tensors
    grad_inp, gp = permute_grads(rid, grad_out, grad_probs, ctx.probs_meta)
    return grad_inp, None, gp, None, None


_permute.register_autograd(_permute_backward, setup_context=_permute_setup)


@define(
    "permute_with_scales(Tensor qbits, Tensor scale_rows, Tensor row_id_map, Tensor? probs, "
    "SymInt num_out_tokens, Tensor? fill=None) -> (Tensor, Tensor, Tensor)"
)
def _permute_with_scales(qbits, scale_rows, row_id_map, probs, num_out_tokens, fill=None):
    """``(bits [N, H], scale rows [N, NB], permuted probs [N] or empty)``: quantized rows
    and their block-scale rows moved together (two permutes; one scatter pass on CUDA)."""
    bits, pp = _permute(qbits, row_id_map, probs, num_out_tokens)
    s_out = _permute(scale_rows, row_id_map, None, num_out_tokens)[0]
    return bits, s_out, pp if probs is not None else qbits.new_empty(0)


@_permute_with_scales.register_cuda
def _permute_with_scales_cuda(qbits, scale_rows, row_id_map, probs, num_out_tokens, fill=None):
    n = num_out_tokens
    s_out = scale_rows.new_empty((n, scale_rows.shape[1]))
    pp = probs.new_empty((n,)) if probs is not None else qbits.new_empty(0)
    bits = permute_rows_triton(qbits, row_id_map, n, probs=probs,
                               probs_out=pp if probs is not None else None, side=scale_rows,
                               side_out=s_out, fill=fill)
    return bits, s_out, pp


@_permute_with_scales.register_fake
def _(qbits, scale_rows, row_id_map, probs, num_out_tokens, fill=None):
    n = num_out_tokens
    pp = probs.new_empty((n,)) if probs is not None else qbits.new_empty(0)
    return (qbits.new_empty((n, qbits.shape[1])),
            scale_rows.new_empty((n, scale_rows.shape[1])), pp)


def _routed_count(fn, routing_map, map_type, num_experts, align_size) -> tuple[int, int]:
    """(output rows, E for a mask map or -1 for an index map) with one host sync; value
    checks ride on the same sync."""
    rm = routing_map
    if map_type == "index":
        ids = rm.long()
        stats = torch.stack([(ids >= 0).sum(), ids.min(), ids.max()]) if rm.numel() else None
        count, lo, hi = stats.tolist() if stats is not None else (0, 0, -1)
        if lo < -1:
            raise ValueError(f"{fn}: routing_map holds expert id {lo}; ids must be in [-1, E)")
        if hi >= C.ID_LIMIT:
            raise ValueError(f"{fn}: routing_map holds expert id {hi}; ids must be below "
                             f"{C.ID_LIMIT} (renumber the experts to [0, E))")
        if num_experts is not None and hi >= num_experts:
            raise ValueError(
                f"{fn}: routing_map holds expert id {hi} but num_experts={num_experts}"
            )
        return count, -1
    counts = (rm != 0).sum(0)
    if align_size > 1:
        counts = (counts + align_size - 1) // align_size * align_size
    return int(counts.sum()), rm.shape[1]


def _check_index_ids(fn, routing_map, num_experts) -> None:
    """Sync-free form of the id checks (one ``aminmax`` and an async assert on CUDA)."""
    bound = min(num_experts, C.ID_LIMIT) if num_experts is not None else C.ID_LIMIT
    what = f"num_experts={num_experts}" if num_experts is not None else (
        f"{C.ID_LIMIT} (renumber the experts to [0, E))")
    C.check_range(fn, routing_map, -1, bound, f"routing_map ids must be >= -1 and < {what}")


def _out_rows(fn, inp, routing_map, map_type, num_out_tokens, num_experts, align_size=1,
              fused=False):
    """Checks; ``(N, num_experts)`` as ints (N counted with a host sync when
    ``num_out_tokens`` is None). ``fused``: a fused quantize-permute follows, whose index
    path asserts the ids only in the small map, without ``num_experts``
    (``_kernel_checks_ids``)."""
    C.check_input(fn, inp)
    C.check_routing_map(fn, inp, routing_map, map_type)
    if num_experts is not None:
        num_experts = C.as_int(fn, "num_experts (or None)", num_experts)
        if num_experts < 1:
            raise ValueError(f"{fn}: num_experts must be a positive int, got {num_experts}")
        e_mask = routing_map.shape[1]
        if (map_type == "mask" and not C.is_compiling() and isinstance(e_mask, int)
                and num_experts != e_mask):  # (no guard on a symbolic E under compile)
            raise ValueError(f"{fn}: num_experts={num_experts} but the mask routing_map has "
                             f"{e_mask} expert columns; drop num_experts or fix the map")
    n = C.check_num_out_tokens(fn, num_out_tokens)
    if n is None:
        if C.is_compiling():
            raise ValueError(
                f"{fn}: under torch.compile or torch.export pass num_out_tokens (an int "
                "bound, e.g. T*K): counting the routed rows needs a host sync")
        n, _ = _routed_count(fn, routing_map, map_type, num_experts, align_size)
    elif map_type == "index" and not _kernel_checks_ids(inp, routing_map, num_experts,
                                                        align_size, fused):
        _check_index_ids(fn, routing_map, num_experts)
    return n, num_experts


def _kernel_checks_ids(inp, routing_map, num_experts, align_size, fused) -> bool:
    """Whether the CUDA kernels that an eager sync-free index permute runs check the ids
    themselves (a device assert, as ``_check_index_ids``' async assert would, without its
    five aten launches): ``qmoe::permute_index`` (``num_experts`` given, no ``quantize=``)
    asserts ``[-1, num_experts)`` in its fused kernel or its one-launch small map; a small
    map built by ``make_row_id_map`` (``tuning.small_index_map``) asserts
    ``[-1, 2**31 - 1)``, enough without ``num_experts``. Traced calls (compile, export,
    ``make_fx``: any dispatch mode) keep the aten check: the path may differ at run
    time, and no guards are made on the sizes."""
    if (not inp.is_cuda or align_size != 1 or C.is_compiling()
            or torch._C._len_torch_dispatch_stack()):
        return False
    t, k = routing_map.shape
    if num_experts is None or fused:
        return num_experts is None and small_index_map(t, k)
    return fused_index_wins(t, k, num_experts) or small_index_map(t, k)


def _map_in_scatter(inp, map_type: str) -> bool:
    """Whether the mask map is built inside the scatter launch (``qmoe::permute_mask``,
    CUDA) rather than by ``make_row_id_map`` before it."""
    return map_type == "mask" and inp.is_cuda


def _checked_permute(fn, inp, probs, routing_map, map_type, num_out_tokens, num_experts, quantize,
             quantize_scale, align_size=1):
    """``(output [N, H], permuted_probs [N] (empty or None without probs), row_id_map)``
    of the public functions."""
    if (map_type == "index" and isinstance(routing_map, torch.Tensor)
            and routing_map.dtype == torch.uint8):
        # ids 0..255 (no -1 sentinel fits); TransformerEngine casts uint8 index maps too
        routing_map = routing_map.to(torch.int16)
    if quantize is None and quantize_scale is not None:
        raise ValueError(f"{fn}: quantize_scale is the scale of a fused per-tensor quantize; "
                         "pass quantize=qmoe.PerTensor() with it, or drop it")
    n, num_experts = _out_rows(fn, inp, routing_map, map_type, num_out_tokens, num_experts,
                               align_size, quantize is not None)
    # Only the probs of kept routes matter: the CUDA kernels check those as they move them
    # (assert_probs_not_nan, a device assert); elsewhere the permuted probs are checked.
    C.check_probs(fn, "probs", probs, inp.shape[0], routing_map.shape[1], inp,
                  "E" if map_type == "mask" else "K")
    out, pp, rid = _run_permute(inp, probs, routing_map, map_type, n, num_experts, quantize,
                                quantize_scale, align_size, fn)
    if probs is not None and not inp.is_cuda:
        C.check_kept_probs(fn, "probs", pp)
    return out, pp, rid


def _run_permute(inp, probs, routing_map, map_type, n, num_experts, quantize, quantize_scale,
                 align_size, fn):
    """The op that ``_checked_permute`` runs for checked arguments: ``(output, permuted_probs,
    row_id_map)``."""
    if quantize is not None:
        return quantize_and_permute(fn, inp, probs, routing_map, map_type == "index",
                                    align_size, n, quantize, quantize_scale)
    if _map_in_scatter(inp, map_type):
        out, pp, _, rid = _permute_mask(inp, routing_map, probs, None, n, align_size)
        return out, pp, rid
    if map_type == "index" and inp.is_cuda and num_experts is not None and align_size == 1:
        # the map built in the scatter launch (qmoe::permute_index keeps the sorting path
        # where the fused kernel lost or was not timed: fused_index_wins)
        out, pp, _, rid = _permute_index(inp, routing_map, probs, None, n,
                                                       num_experts)
        return out, pp, rid
    rid, fill = make_row_id_map(routing_map, n, map_type == "index",
                                               align_size)
    out, pp = _permute(inp, rid, probs, n, fill)
    return out, pp, rid


@C.user_errors
def moe_permute(
    inp: torch.Tensor,
    routing_map: torch.Tensor,
    num_out_tokens: int | None = None,
    max_token_num: int = -1,
    map_type: str = "mask",
    *,
    num_experts: int | None = None,
    quantize: Recipe | None = None,
    quantize_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the rows of ``inp`` by expert: ``(output, row_id_map)``.

    Args:
        inp: ``[T, H]`` fp32/bf16/fp16, or a qmoe FP8 tensor (``Float8Tensor``,
            ``Float8BlockwiseTensor``, ``MXFP8Tensor``: its bits and scales are moved).
        routing_map: ``map_type="mask"``: ``[T, E]`` bool, or integer holding only 0 and
            1 (other values raise: ``[T, K]`` expert ids need ``map_type="index"``; a
            ``ValueError`` on CPU, an async device assert on CUDA, no host sync).
            ``map_type="index"``: ``[T, K]`` integer expert ids in ``[-1, E)``; ``-1`` is
            "not routed" (the expert-parallel sentinel). uint8 ids are cast to int16 (one
            small copy).
        num_out_tokens: rows of the output, N. ``None`` (or ``-1``, TransformerEngine's
            old default) means all routed rows, counted with **one host sync**. An int
            makes the call sync-free: routes whose row would be ``>= N`` are dropped
            (never written, and zero in unpermute and the backward) and rows no route
            fills are zero, so a fixed-size buffer is always safe. A 0-d integer tensor
            (TransformerEngine's callers pass ``tokens_per_expert.sum()``) is read with
            ``.item()``: a host sync for a CUDA tensor, and a graph break under
            torch.compile unless ``capture_scalar_outputs`` makes it a data-dependent
            size (then it must be ``>= 0``).
        max_token_num: accepted for TransformerEngine compatibility; qmoe keeps no
            workspace, so it is unused.
        map_type: ``"mask"`` or ``"index"``.
        num_experts: with an index map, ids ``>= num_experts`` raise, and on CUDA
            (without ``quantize=``) the call goes through ``qmoe::permute_index``, which
            builds the map in the scatter launch where that was measured faster
            (``fused_index_wins``: E <= 256, K <= 16, not a small map); without it, a
            sorting map first. With a mask map it must equal the mask's column count (E)
            when given. Ids below ``-1``
            and ids ``>= 2**31 - 1`` always raise (a ``ValueError`` on the syncing path and
            on CPU; an async device assert on the sync-free CUDA path).
        quantize: a recipe (``qmoe.Blockwise()``, ``qmoe.MXFP8()``, ``qmoe.PerTensor()``)
            to quantize ``inp`` (high precision) on the way: each token row is read once
            and its K quantized copies and scale rows are written straight into the
            permuted layout (one pass on CUDA). The output is the recipe's quantized type,
            bit for bit ``moe_permute(qmoe.quantize(inp, recipe), ...)``. PerTensor computes
            its scale from ``inp`` first (a device reduction) unless ``quantize_scale``
            (a one-element tensor) gives it.

    Returns:
        ``output`` ``[N, H]``: in ``inp.dtype``, or of ``inp``'s FP8 type, or with
        ``quantize`` the recipe's FP8 type (its ``dtype``, the dequantized one, is
        ``inp.dtype``); expert-major, token-minor (all rows of expert 0 in token order,
        then expert 1, ...); and ``row_id_map`` ``[T, 2*S + 1]`` int32 (S = E or K), which
        ``moe_unpermute`` takes back. Mask and index maps of the same routing give the same
        output. Differentiable in ``inp`` (with ``quantize``, the gradient reaches ``inp``
        in high precision: the output gradient unpermuted).
    """
    del max_token_num
    out, _, rid = _checked_permute("moe_permute", inp, None, routing_map, map_type, num_out_tokens,
                           num_experts, quantize, quantize_scale)
    return out, rid


@C.user_errors
def moe_permute_with_probs(
    inp: torch.Tensor,
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    num_out_tokens: int | None = None,
    *,
    map_type: str = "mask",
    num_experts: int | None = None,
    quantize: Recipe | None = None,
    quantize_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe_permute`` that also permutes ``probs``: ``(output, permuted_probs, row_id_map)``.

    ``probs`` is ``[T, E]`` (mask map) or ``[T, K]`` (index map), float. ``permuted_probs``
    is ``[N]`` in ``probs.dtype``: the prob of each output row's route (zero on rows no
    route fills). Differentiable in ``inp`` and ``probs``. Only the entries of kept routes
    are read: NaN there raises (on CPU a ``ValueError``, on CUDA a device assert), NaN
    elsewhere (tokens with no route, dropped routes) is ignored. Host sync as in ``moe_permute``;
    ``quantize`` / ``quantize_scale`` as there (fused quantize-and-permute).
    """
    fn = "moe_permute_with_probs"
    if probs is None:
        raise TypeError(f"{fn}: probs is required; use moe_permute without probs")
    return _checked_permute(fn, inp, probs, routing_map, map_type, num_out_tokens, num_experts,
                    quantize, quantize_scale)


@C.user_errors
def moe_permute_and_pad_with_probs(
    inp: torch.Tensor,
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    tokens_per_expert: torch.Tensor | None,
    align_size: int,
    *,
    num_out_tokens: int | None = None,
    quantize: Recipe | None = None,
    quantize_scale: torch.Tensor | None = None,
):
    """Permute with each expert's group padded to a multiple of ``align_size``.
    ``routing_map`` is a ``[T, E]`` mask (bool, or integer holding only 0 and 1: other
    values raise, as in ``moe_permute``); ``probs`` as in ``moe_permute_with_probs``.
    ``quantize`` / ``quantize_scale``: fused quantize-and-permute, as in ``moe_permute``.

    Returns ``(output [N, H], permuted_probs [N], row_id_map, pad_offsets [E] int64 or
    None, target_tokens_per_expert [E] int64)``. Padding rows sit at the end of each
    expert's group; their data and probs are zero. ``pad_offsets[e]`` is the padding
    before expert e's group (exclusive cumsum), as TransformerEngine defines it.

    Two forms:

    * TransformerEngine's (``num_out_tokens=None``): N is the padded total, counted with
      **one host sync**; ``tokens_per_expert`` (``[E]``, must equal ``routing_map``'s
      column counts, checked on the same sync; on the CPU or inp's device) may also be ``None``;
      ``pad_offsets`` is ``None`` when no group needed padding.
    * Sync-free (``num_out_tokens=<upper bound>``, works under ``fullgraph=True`` and CUDA
      graph capture): N is the bound, rows past the padded total are zero, rows past N
      are dropped, and ``pad_offsets`` is always a tensor. A ``tokens_per_expert`` on
      inp's device is checked without a sync (an async device assert on CUDA; at once on
      the CPU); a CPU one beside CUDA inputs is not checked in this form.
    """
    fn = "moe_permute_and_pad_with_probs"
    if probs is None:
        raise TypeError(f"{fn}: probs is required ([T, E] float; zeros if the experts need "
                        "no weights)")
    align_size = C.as_int(fn, "align_size", align_size)
    if align_size < 1:
        raise ValueError(f"{fn}: align_size must be a positive int, got {align_size}")
    # (plain ints only: a guard on a symbolic E would narrow it, which export refuses)
    if (isinstance(routing_map, torch.Tensor) and routing_map.dim() == 2
            and isinstance(routing_map.shape[1], int) and isinstance(align_size, int)
            and align_size > C.ID_LIMIT // (routing_map.shape[1] + 1)):
        raise ValueError(f"{fn}: align_size {align_size} could pad past 2**31 rows "
                         "(row_id_map rows are int32); use the grouped GEMM's alignment")
    num_out_tokens = C.check_num_out_tokens(fn, num_out_tokens)  # -1 (or tensor(-1)): None
    C.check_input(fn, inp)
    C.check_routing_map(fn, inp, routing_map, "mask", index_fix=C.MASK_FROM_IDS)
    if tokens_per_expert is not None:
        # on the CPU or inp's device: Megatron's DeepEP path builds it on the CPU
        # (TransformerEngine moves it to inp's device); qmoe only checks it, on the sync
        if isinstance(tokens_per_expert, torch.Tensor) and (
                tokens_per_expert.dtype.is_floating_point):
            raise TypeError(f"{fn}: tokens_per_expert must hold integer counts, got "
                            f"{tokens_per_expert.dtype}; pass tokens_per_expert.long() (or "
                            "None: the mask's column counts)")
        C.check_tensor(fn, "tokens_per_expert", tokens_per_expert, ndim=1, dtypes=C.INT_DTYPES)
        if tokens_per_expert.device.type != "cpu":
            C.check_same_device(fn, "inp", inp, tokens_per_expert=tokens_per_expert)
        if tokens_per_expert.shape[0] != routing_map.shape[1]:
            raise ValueError(
                f"{fn}: tokens_per_expert must be [E] = [{routing_map.shape[1]}], got "
                f"{tuple(tokens_per_expert.shape)}"
            )
    counts = (routing_map != 0).sum(0)
    target = (counts + align_size - 1) // align_size * align_size
    pads = target - counts
    pad_offsets = torch.cumsum(pads, 0) - pads
    if num_out_tokens is None:  # TransformerEngine's form: N and the checks on one sync
        if C.is_compiling():
            raise ValueError(
                f"{fn}: under torch.compile or torch.export pass num_out_tokens (an upper "
                "bound on the padded rows): counting them needs a host sync")
        e = counts.shape[0]
        on_dev = tokens_per_expert is not None and tokens_per_expert.device == counts.device
        host = torch.cat([counts, target, tokens_per_expert.long()] if on_dev
                         else [counts, target]).cpu()
        counts_h, target_h = host[:e], host[e : 2 * e]
        tpe_h = host[2 * e :] if on_dev else tokens_per_expert
        if tpe_h is not None and not torch.equal(tpe_h.long(), counts_h):
            raise ValueError(
                f"{fn}: tokens_per_expert does not match routing_map's column counts; pass "
                "routing_map.sum(0) (or None)"
            )
        num_out_tokens = int(target_h.sum())
        if not bool((target_h != counts_h).any()):
            pad_offsets = None
    elif tokens_per_expert is not None and tokens_per_expert.device == counts.device:
        # sync-free: an async device check (CPU: at once); a CPU tokens_per_expert beside
        # CUDA inputs stays unchecked (a copy to the device would not capture in a graph)
        C.check_values(fn, (tokens_per_expert.long() == counts).all(),
                       "tokens_per_expert does not match routing_map's column counts; pass "
                       "routing_map.sum(0) (or None)")
    out, pp, rid = _checked_permute(fn, inp, probs, routing_map, "mask", num_out_tokens, None,
                            quantize, quantize_scale, align_size)
    return out, pp, rid, pad_offsets, target

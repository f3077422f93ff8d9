import torch

from qmoe.ops import reference as R

KINDS = ["random", "empty_experts", "no_route_tokens", "sentinels", "one_expert"]


def reference_routes(routing_map, map_type, n, align=1):
    """``(rows, tokens, columns)`` int64 of every route kept in ``n`` output rows, from the
    reference (``qmoe.ops.reference``: the definitions, not qmoe's row_id_map)."""
    routes = R.routes_of(routing_map, map_type)
    _, _, kept = R.permute(torch.zeros(routing_map.shape[0], 1), routing_map.cpu(), map_type,
                           n, align_size=align)
    live = [(p, t, col) for (t, _e, col), p in zip(routes, kept) if p >= 0]
    return tuple(torch.tensor([r[i] for r in live], dtype=torch.long) for i in range(3))


def routing(t: int, e: int, k: int, kind: str = "random", device="cpu"):
    """``(ids [T, K] int64 with -1 for unused slots, mask [T, E] bool)`` of one routing.

    Kinds: random top-k; empty_experts (only even experts get tokens); no_route_tokens
    (a third of the tokens go nowhere); sentinels (scattered -1 slots); one_expert (every
    token to the last expert only).
    """
    k = min(k, e)
    ids = torch.full((t, k), -1, dtype=torch.long)
    if kind == "one_expert":
        ids[:, 0] = e - 1
    elif kind == "empty_experts":
        half = -(-e // 2)
        kk = min(k, half)
        ids[:, :kk] = torch.rand(t, half).argsort(dim=1)[:, :kk] * 2
    else:
        ids = torch.rand(t, e).argsort(dim=1)[:, :k]
        if kind == "no_route_tokens":
            ids[torch.rand(t) < 0.33] = -1
        elif kind == "sentinels":
            ids = torch.where(torch.rand(t, k) < 0.3, -1, ids)
    mask = torch.zeros(t, e + 1, dtype=torch.bool)
    mask.scatter_(1, torch.where(ids >= 0, ids, e), True)
    return ids.to(device), mask[:, :e].contiguous().to(device)


def map_then_permute(x, routing_map, n, is_index, align, probs=None, side=None):
    """The two-step CPU path that the fused permute kernels must equal: ``make_row_id_map``
    then the torch permute of rows, probs and side rows; ``(out, pp or None, side_out or
    None, row_id_map)``."""
    from qmoe.ops import torch_impl as TI
    from qmoe.ops.row_id_map import make_row_id_map

    rid, _ = make_row_id_map(routing_map.cpu(), n, is_index, align)
    pp = torch.empty(n, dtype=probs.dtype) if probs is not None else None
    so = torch.empty(n, side.shape[1], dtype=side.dtype) if side is not None else None
    out = TI.permute_rows(x.cpu(), rid, n, probs=None if probs is None else probs.cpu(),
                         probs_out=pp, side=None if side is None else side.cpu(), side_out=so)
    return out, pp, so, rid


def _assert_merge_bound(got, ref, mag, out_eps):
    """``|got - ref| <= out_eps * |ref| + 2**-20 * mag + sub``: fp32 accumulation (2**-20 of
    the sum of |terms| ``mag``, enough for 16 routes) plus one rounding to the output dtype
    (``out_eps``: half an ulp, relative: 2**-24 fp32, 2**-11 fp16, 2**-8 bf16; ``sub``: half
    the dtype's smallest subnormal, the rounding's absolute bound below its normal range:
    2**-25 for fp16, where a merge of randn rows meets it)."""
    fi = torch.finfo(got.dtype)
    sub = fi.tiny * fi.eps / 2
    err = (got.double().cpu() - ref).abs()
    bound = out_eps * ref.abs() + 2.0**-20 * mag + sub
    bad = (~(err <= bound)).nonzero()  # NaN (an unwritten, poisoned element) fails too
    assert len(bad) == 0, (f"{len(bad)} elements past the bound, first at {bad[0].tolist()}: "
                           f"got {float(got[tuple(bad[0])])}, fp64 {float(ref[tuple(bad[0])])}, "
                           f"bound {float(bound[tuple(bad[0])])}")


def assert_bf16_merge(y, rows, routing_map, map_type, w, n=None):
    """``y`` (a bf16 merge of ``rows`` [N, H] by ``w``) against the fp64 reference
    (``R.unpermute``) within ``_assert_merge_bound``. A merge accumulated in bf16 fails."""
    from qmoe.ops import reference as R

    rows, rm = rows.double().cpu(), routing_map.cpu()
    w = None if w is None else w.double().cpu()
    ref = R.unpermute(rows, rm, map_type, w, n)
    mag = R.unpermute(rows.abs(), rm, map_type, None if w is None else w.abs(), n)
    _assert_merge_bound(y, ref, mag, 2.0**-8)


def merge_fp64(rows, rid, w=None):
    """The merge of ``rows`` [N, H] by a row_id_map ``rid`` [T, 2S+1] (weights ``w`` [T, S]
    optional) in fp64, read straight from the map's format with Python loops: an oracle
    that shares no code with qmoe's merges (small T only)."""
    s = (rid.shape[1] - 1) // 2
    rows, rid = rows.double().cpu(), rid.cpu()
    out = torch.zeros(rid.shape[0], rows.shape[1], dtype=torch.float64)
    for t in range(rid.shape[0]):
        for j in range(int(rid[t, 2 * s])):
            wt = 1.0 if w is None else float(w[t, int(rid[t, s + j])])
            out[t] += rows[int(rid[t, j])] * wt
    return out


def assert_merge_close(got, rows, rid, w=None, out_eps=2.0**-24):
    """``got`` against ``merge_fp64`` within ``_assert_merge_bound``."""
    ref = merge_fp64(rows, rid, w)
    mag = merge_fp64(rows.abs(), rid, None if w is None else w.abs())
    _assert_merge_bound(got, ref, mag, out_eps)


def last_routed_row(mask, align):
    """One past the last output row a route fills when each expert's group of the mask
    ``[T, E]`` is padded to ``align``: a bound below it drops routes for sure (a bound
    below the padded total may cut padding only)."""
    counts = mask.sum(0).cpu()
    padded = (counts + align - 1) // align * align
    starts = torch.cumsum(padded, 0) - padded
    return int((starts + counts)[counts > 0].max()) if bool((counts > 0).any()) else 0


def mask_map_triton(mask, n, align, tiling=None):
    """``(row_id_map, fill)`` of a ``[T, E]`` mask (T, E >= 1) from the map's Triton
    launches, ``fill`` allocated as ``make_row_id_map`` does; ``tiling`` a ``MaskMapTiling``."""
    from qmoe.ops.kernels.row_id_map import mask_rows_triton
    from qmoe.ops.launch import fill_count

    fill = torch.empty((fill_count(mask, False, align), 2), dtype=torch.int32,
                       device=mask.device)
    return mask_rows_triton(mask, n, align, fill, tiling), fill

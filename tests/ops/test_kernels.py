"""The Triton kernels against the torch path, into poisoned outputs.

CUDA, or CPU under TRITON_INTERPRET=1 (there in fp32 only: the interpreter's fp32 ->
bf16/fp16 casts truncate instead of rounding to nearest even).
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qmoe._intmath import next_pow2
from qmoe.ops import torch_impl as TI
from qmoe.ops import tuning as T
from qmoe.ops.kernels import permute as KP
from qmoe.ops.kernels import sort_chunks as KS
from qmoe.ops.kernels import unpermute as KU
from qmoe.ops.row_id_map import make_row_id_map
from qmoe.ops.tuning import MaskMapTiling
from tests.ops.helpers import assert_merge_close, mask_map_triton, merge_fp64, routing
from tests.tensors.helpers import assert_same_bits


def _dtypes(dev):
    return [torch.float32] if dev == "cpu" else [torch.float32, torch.bfloat16, torch.float16]


def _poison(shape, dtype, dev):
    return torch.full(shape, float("nan"), dtype=dtype, device=dev)


CASES = [  # (T, H, E, K, kind, N offset)
    (1, 1, 4, 2, "random", 0), (63, 17, 7, 3, "sentinels", 0), (64, 300, 8, 8, "random", -20),
    (40, 64, 256, 8, "no_route_tokens", 11), (20, 33, 16, 1, "one_expert", 0),
    (30, 16, 8, 2, "empty_experts", 5),
    (3, 7168, 8, 3, "sentinels", 0), (2, 4096, 16, 8, "random", -3),  # the widest tiles
]


@pytest.mark.parametrize("t,h,e,k,kind,extra", CASES)
@pytest.mark.parametrize("map_type", ["mask", "index"])
def test_permute_unpermute_kernels(kdevice, t, h, e, k, kind, extra, map_type):
    ids, mask = routing(t, e, k, kind, kdevice)
    rm = mask if map_type == "mask" else ids
    n = max(0, int(mask.sum()) + extra)
    rid, fill = make_row_id_map(rm, n, map_type == "index", 1)
    for dtype in _dtypes(kdevice):
        x = torch.randn(t, h, device=kdevice).to(dtype)
        w = torch.rand(t, rm.shape[1], device=kdevice)
        # Rows no route writes are zeroed by a flagged second pass (fill=None, as for maps
        # built elsewhere) or inside the scatter launch from the map's fill ranges.
        for weights, f in ((None, None), (w, None), (None, fill), (w, fill)):
            got = KP.permute_rows_triton(x, rid, n, weights, fill=f,
                                 out=_poison((n, h), dtype, kdevice))
            assert_same_bits(got, TI.permute_rows(x, rid, n, weights))
        # Permuted probs and side rows (block scales) ride in the same pass (into poison).
        side = torch.randn(t, 5, device=kdevice)
        for sd, f in ((side, None), (side.view(torch.uint8)[:, :7], None), (side, fill)):
            pp = _poison((n,), w.dtype, kdevice)
            so = torch.full((n, sd.shape[1]), 0xFF, device=kdevice).to(sd.dtype)
            got = KP.permute_rows_triton(x, rid, n, probs=w, probs_out=pp, side=sd, side_out=so,
                                 fill=f, out=_poison((n, h), dtype, kdevice))
            pp_ref = torch.empty(n, dtype=w.dtype, device=kdevice)
            so_ref = torch.empty_like(so)
            want = TI.permute_rows(x, rid, n, probs=w, probs_out=pp_ref, side=sd,
                                  side_out=so_ref)
            assert_same_bits(got, want)
            assert_same_bits(pp, pp_ref)
            assert_same_bits(so, so_ref)
        y = torch.randn(n, h, device=kdevice).to(dtype)
        got = KU.unpermute_rows_triton(y, rid, None, out=_poison((t, h), dtype, kdevice))
        # The CPU torch path adds in row order, as the kernel does (CUDA's index_add_ does not).
        want = TI.unpermute_rows(y.cpu(), rid.cpu(), None)
        assert_same_bits(got.cpu(), want)
        # Weighted: the GPU fuses x * w + acc into one FMA, so compare with an fp64 merge
        # within fp32 accumulation and output rounding.
        got = KU.unpermute_rows_triton(y, rid, w, out=_poison((t, h), dtype, kdevice))
        eps = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
        assert_merge_close(got, y, rid, w, eps[dtype])


@pytest.mark.parametrize("h", [1025, 2880])
def test_merge_in_column_tiles(kdevice, h):
    """Wide rows merge in 512-column programs (evict-first): several column programs per
    token, the last one partial; 8 routes a token (odd and even counts, the pairs loop)."""
    assert T.merge_tile(h, True) == T.merge_tile(h, False) == (512, 1, "evict_first", True)
    assert T.merge_tile(4096, False) == (4096, 8, "", False)  # one route a step
    t, e, k = 9, 16, 8
    ids, mask = routing(t, e, k, "sentinels", kdevice)
    n = int(mask.sum()) - 2  # two routes dropped
    rid, _ = make_row_id_map(mask, n, False, 1)
    y = torch.randn(n, h, device=kdevice)
    got = KU.unpermute_rows_triton(y, rid, None, out=_poison((t, h), y.dtype, kdevice))
    assert_same_bits(got.cpu(), TI.unpermute_rows(y.cpu(), rid.cpu(), None))
    w = torch.rand(t, e, device=kdevice)
    got = KU.unpermute_rows_triton(y, rid, w, out=_poison((t, h), y.dtype, kdevice))
    assert_merge_close(got, y, rid, w)


@pytest.mark.parametrize("t,h,e,k,kind,extra", CASES + [
    (9, 2880, 16, 8, "sentinels", -2),  # 2 routes a step, 1024-column tiles, partial last
    (5, 4100, 16, 7, "random", 3),  # 4 routes a step (H >= 4096, 16 columns)
])
@pytest.mark.parametrize("map_type", ["mask", "index"])
@pytest.mark.parametrize("flags", [False, True])
def test_merge_backward_one_pass(kdevice, poisoned_empty, t, h, e, k, kind, extra, map_type,
                                 flags, monkeypatch):
    """Both gradients of the weighted merge in one kernel (``merge_backward_triton``):
    grad_inp bit-exact against the torch scatter of ``grad * weight`` (rows no token
    reads zero, into poison: zeroed first, or with ``flags`` flagged and zeroed after, as
    above ``MERGE_BACKWARD_FILL_BYTES``), the weights' gradient against fp64 dot products
    (exact zeros off the kept routes) in the weights' dtype; dropped routes, spare rows,
    1-column rows, wide rows in 1024-column tiles (the last partial), two and four routes
    a step."""
    from qmoe.ops.kernels.unpermute import merge_backward_triton

    if flags:
        monkeypatch.setattr(KU, "MERGE_BACKWARD_FILL_BYTES", 0)

    ids, mask = routing(t, e, k, kind, kdevice)
    rm = mask if map_type == "mask" else ids
    n = max(0, int(mask.sum()) + extra)
    rid, _ = make_row_id_map(rm, n, map_type == "index", 1)
    tok, row, col = TI.routes(rid)
    for dtype in _dtypes(kdevice):
        g = torch.randn(t, h, device=kdevice).to(dtype)
        y = torch.randn(n, h, device=kdevice).to(dtype)
        w = torch.rand(t, rm.shape[1], device=kdevice).to(dtype)
        gi, gw = merge_backward_triton(g, y, rid, w, out=_poison((n, h), dtype, kdevice))
        if h in (2880, 4100):  # the cases added for the routes a step
            assert T.merge_backward_tile(h, rm.shape[1])[0] == (
                4 if h == 4100 and map_type == "mask" else 2)  # index: K = 7 columns
        assert_same_bits(gi.cpu(), TI.permute_rows(g.cpu(), rid.cpu(), n, w.cpu()))
        assert gw.dtype == w.dtype and gw.shape == w.shape
        ref = torch.zeros(t, rm.shape[1], dtype=torch.float64, device=kdevice)
        ref[tok, col] = (g.double()[tok] * y.double()[row]).sum(1)
        tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype]
        torch.testing.assert_close(gw.double(), ref, rtol=tol, atol=tol * max(1, h) ** 0.5)
        off = torch.ones_like(ref, dtype=torch.bool)
        off[tok, col] = False
        assert (gw[off] == 0).all()


@pytest.mark.parametrize("t,h,e,k,kind,extra", CASES + [(5, 0, 4, 2, "random", 0),
                                                   (0, 8, 4, 2, "random", 0)])
@pytest.mark.parametrize("map_type", ["mask", "index"])
def test_permute_backward_one_launch(kdevice, t, h, e, k, kind, extra, map_type):
    """A permute's backward with probs in one launch (``permute_backward_triton``): the
    merge of the rows' gradient bit-exact against the merge alone, and the probs' gradient
    (permuted probs' gradient at each kept route's column, zeros elsewhere, in the probs'
    dtype) bit-exact against the torch ``probs_grad``; dropped routes, spare rows, H = 0,
    T = 0."""
    from qmoe.ops.unpermute import probs_grad

    ids, mask = routing(t, e, k, kind, kdevice)
    rm = mask if map_type == "mask" else ids
    n = max(0, int(mask.sum()) + extra)
    rid, _ = make_row_id_map(rm, n, map_type == "index", 1)
    p = rm.shape[1]
    for dtype in _dtypes(kdevice):
        g = torch.randn(n, h, device=kdevice).to(dtype)
        gpp = torch.randn(n, device=kdevice)
        for pdtype in (torch.float32, dtype, torch.float64):
            gi, gp = KU.permute_backward_triton(g, rid, gpp, p, pdtype)
            assert_same_bits(gi, KU.unpermute_rows_triton(g, rid))
            assert gp.dtype == pdtype and gp.shape == (t, p)
            assert_same_bits(gp, probs_grad(rid, gpp, t, p, pdtype))


def test_merge_backward_empty(kdevice):
    """No tokens: grad_inp is all zeros (N rows no token reads), the weights' gradient
    [0, P]; no rows: grad_inp [0, H], the weights' gradient zero."""
    from qmoe.ops.kernels.unpermute import merge_backward_triton

    rid = torch.zeros(0, 9, dtype=torch.int32, device=kdevice)
    gi, gw = merge_backward_triton(torch.zeros(0, 8, device=kdevice),
                                   torch.randn(5, 8, device=kdevice), rid,
                                   torch.zeros(0, 4, device=kdevice),
                                   out=_poison((5, 8), torch.float32, kdevice))
    assert torch.equal(gi, torch.zeros(5, 8, device=kdevice)) and gw.shape == (0, 4)
    _, mask = routing(6, 4, 2, "random", kdevice)
    rid, _ = make_row_id_map(mask, 0, False, 1)  # every route dropped
    gi, gw = merge_backward_triton(torch.randn(6, 8, device=kdevice),
                                   torch.zeros(0, 8, device=kdevice), rid,
                                   torch.rand(6, 4, device=kdevice))
    assert gi.shape == (0, 8) and torch.equal(gw, torch.zeros(6, 4, device=kdevice))


def test_padded_map_kernels_zero_padding(kdevice):
    t, h, e = 50, 40, 8
    ids, mask = routing(t, e, 2, "empty_experts", kdevice)
    x = torch.randn(t, h, device=kdevice)
    for n in (200, 90, 0):  # spare rows past the padded total; dropping; nothing
        rid, fill = make_row_id_map(mask, n, False, 16)
        want = TI.permute_rows(x, rid, n)
        for f in (None, fill):
            got = KP.permute_rows_triton(x, rid, n, fill=f,
                                 out=_poison((n, h), x.dtype, kdevice))
            assert_same_bits(got, want)
            assert not got.isnan().any()
    # No tokens at all: the fill programs alone zero the whole output.
    rid, fill = make_row_id_map(mask[:0], 40, False, 16)
    got = KP.permute_rows_triton(x[:0], rid, 40, fill=fill,
                         out=_poison((40, h), x.dtype, kdevice))
    assert_same_bits(got, torch.zeros(40, h, device=kdevice))


@pytest.mark.parametrize("r,h", [(1, 1), (63, 17), (1025, 130)])
def test_gather_rows_kernel(kdevice, r, h):
    x = torch.randn(r + 3, h, device=kdevice)
    src = torch.randint(0, r + 3, (r,), device=kdevice)
    got = KS.gather_rows_triton(x, src, out=_poison((r, h), x.dtype, kdevice))
    assert_same_bits(got, x[src])


@pytest.mark.parametrize("t,e,k,kind", [
    (1, 4, 2, "random"), (63, 7, 3, "sentinels"), (100, 256, 8, "no_route_tokens"),
    (50, 1024, 4, "random"), (33, 8, 8, "one_expert"), (0, 4, 2, "random"),
    (1025, 17, 3, "empty_experts"),
])
@pytest.mark.parametrize("align", [1, 16])
@pytest.mark.parametrize("one_launch", [False, True], ids=["three_launches", "one_launch"])
def test_mask_map_kernel_matches_torch(kdevice, t, e, k, kind, align, one_launch):
    from qmoe.ops.row_id_map import _mask_rows, fill_rows

    if one_launch and t * next_pow2(e) > T.SMALL_MAP_BYTES:
        pytest.skip("the one-launch map serves small masks only (each program reads it all)")
    ids, mask = routing(t, e, k, kind, kdevice)
    counts = mask.sum(0) if align > 1 else mask.sum()
    # N below, at and above the routed count; the mask as bool and as int32 in turn (each
    # dtype meets two of the three N: interpreter time at T 1025)
    masks = (mask, mask.to(torch.int32))
    for i, n in enumerate((int(mask.sum()), int(mask.sum()) // 2, 1000)):
        for m in (masks[i % 2],) if t > 256 else masks:
            rid, fill = mask_map_triton(m, n, align, MaskMapTiling(one_launch=one_launch))
            assert torch.equal(rid, _mask_rows(m, n, align))
            assert torch.equal(fill, fill_rows(counts, n, align))


@pytest.mark.parametrize("t,e,k,kind", [
    (1, 4, 2, "random"), (63, 7, 3, "sentinels"), (100, 256, 8, "no_route_tokens"),
    (33, 8, 8, "one_expert"), (300, 40, 6, "empty_experts"), (5, 3, 1, "random"),
])
def test_index_map_kernel_matches_torch(kdevice, t, e, k, kind):
    """The one-launch index map (rank counting, no sort) equals the sorting torch path,
    for several id dtypes, N below/at/above the routed count, and T*K = 1800 entries
    (the counting walk takes two steps)."""
    from qmoe.ops.kernels.row_id_map import index_rows_triton
    from qmoe.ops.row_id_map import _index_rows, fill_rows

    ids, _ = routing(t, e, k, kind, kdevice)
    routed = int((ids >= 0).sum())
    ns = (routed, routed // 2, routed + 9)
    dts = (torch.int64, torch.int32, torch.int16, torch.int8)[: 4 if e <= 127 else 3]
    # every N with every id dtype; at T*K >= 1024 each dtype with one N in turn
    pairs = [(n, dt) for n in ns for dt in dts] if t * k < 1024 else [
        (ns[i % len(ns)], dt) for i, dt in enumerate(dts)]
    for n, dt in pairs:
        rid, fill = index_rows_triton(ids.to(dt), n)
        assert torch.equal(rid, _index_rows(ids, n))
        assert torch.equal(fill, fill_rows((ids >= 0).sum(), n, 1))


def test_index_map_kernel_duplicate_ids(kdevice):
    """A token may name one expert in several slots (no mask can say that): its routes
    rank in slot order, as the stable sorts of the torch path put them."""
    from qmoe.ops.kernels.row_id_map import index_rows_triton
    from qmoe.ops.row_id_map import _index_rows

    ids = torch.tensor([[2, 0, 2, -1], [1, 1, 1, 1], [-1, -1, -1, -1], [0, 2, 0, 1]],
                       device=kdevice)
    for n in (11, 6, 20):
        rid, _ = index_rows_triton(ids, n)
        assert torch.equal(rid, _index_rows(ids, n))
    # a strided view (every other column of a wider matrix)
    wide = torch.stack([ids, ids.flip(1)], dim=2).reshape(4, 8)
    rid, _ = index_rows_triton(wide[:, ::2], 9)
    assert torch.equal(rid, _index_rows(ids, 9))


def test_index_map_kernel_asserts_ids(kdevice, interpreter_asserts, monkeypatch):
    """The one-launch index map checks the ids itself (the public ops' CUDA id check on
    this path): below -1, at or past the bound (num_experts, else 2**31 - 1; int64 ids
    past 2**32 included, not narrowed first) trip its device assert. On CUDA an assert
    ends the context, so this runs under the interpreter only."""
    if kdevice != "cpu":
        pytest.skip("a device assert ends the CUDA context")
    from triton.runtime.errors import InterpreterError

    from qmoe.ops.kernels import row_id_map as KR
    from qmoe.ops.kernels.row_id_map import index_rows_triton
    from qmoe.ops.permute_index import _permute_index_cuda

    ids = torch.tensor([[0, 1], [3, -1], [2, 2]])
    index_rows_triton(ids, 4)  # fine as given, with and without a bound
    index_rows_triton(ids, 4, 4)
    index_rows_triton(ids.clamp(min=0).to(torch.uint8), 4, 4)  # unsigned ids compile
    for bad, e in ((ids, 3), (ids.masked_fill(ids == -1, -2), None),
                   (ids.masked_fill(ids == 3, 2**31 - 1), None),
                   (ids.masked_fill(ids == 3, 2**32 + 1), None),
                   (ids.masked_fill(ids == 3, 2**32 + 1), 2**40)):  # bound capped at 2**31-1
        with pytest.raises(InterpreterError, match="ids must be >= -1 and < num_experts"):
            index_rows_triton(bad, 4, e)
    # qmoe::permute_index's CUDA body (run here on CPU tensors): a small map with the bound
    x = torch.randn(3, 8)
    with pytest.raises(InterpreterError, match="ids must be >= -1 and < num_experts"):
        _permute_index_cuda(x, ids, None, None, 4, 3)
    # the launch compiles the assert in on CUDA (the interpreter runs it either way here)
    seen = []
    real = KR.launch
    monkeypatch.setattr(KR, "launch", lambda k, g, *a, **o: (seen.append((a, o)), real(
        k, g, *a, **o))[1])
    index_rows_triton(ids, 4, 5)
    (args, options), = seen
    assert options["debug"] is True and args[6] == 5, (args, options)


# blocks of at most 16 tokens, as the launcher's (map_tiling): on the GPU the compile of a
# 64-token block takes about 105 s, of a 32-token one 19 s
@pytest.mark.parametrize("tiling", [(1, 1, 1), (4, 2, 1), (16, 1, 16), (16, 4, 3)])
@pytest.mark.parametrize("one_launch", [False, True], ids=["three_launches", "one_launch"])
def test_mask_map_kernel_tilings(kdevice, tiling, one_launch):
    """Blocks of one token, loads one row ahead, all rows ahead, a prefetch depth that does
    not divide the block, a last block cut short (300 tokens): the same map and fill. The
    one-launch form walks the 300 rows in several steps (128 rows a step at E = 40)."""
    from qmoe.ops.row_id_map import _mask_rows, fill_rows

    ids, mask = routing(300, 40, 3, "sentinels", kdevice)
    for n in (int(mask.sum()) - 7, int(mask.sum()) + 50):
        for align in (1, 8):
            tl = MaskMapTiling(*tiling, one_launch=one_launch)
            got, fill = mask_map_triton(mask, n, align, tl)
            assert torch.equal(got, _mask_rows(mask, n, align))
            assert torch.equal(fill, fill_rows(mask.sum(0) if align > 1 else mask.sum(), n,
                                               align))


def test_mask_map_block_scan_over_several_chunks(kdevice):
    """More blocks than one step of the block scan takes (512 at E = 520, whose programs
    own 8 experts each): the running per-expert count must carry from one chunk of blocks
    to the next."""
    from qmoe.ops.row_id_map import _mask_rows, fill_rows

    ids, mask = routing(600, 520, 3, "random", kdevice)
    n = int(mask.sum()) - 5
    got, fill = mask_map_triton(mask, n, 4, MaskMapTiling(1, 1, 1))
    assert torch.equal(got, _mask_rows(mask, n, 4))
    assert torch.equal(fill, fill_rows(mask.sum(0), n, 4))


def test_merge_of_a_map_without_slots_is_zero(kdevice):
    """A map of S = 0 (only the count column): nothing to read, zeros out, weights of zero
    columns accepted."""
    t, h = 6, 40
    y = torch.randn(5, h, device=kdevice)
    empty = torch.zeros(t, 1, dtype=torch.int32, device=kdevice)
    for w in (None, torch.rand(t, 0, device=kdevice)):
        got = KU.unpermute_rows_triton(y, empty, w)
        assert torch.equal(got, torch.zeros(t, h, device=kdevice))


def test_mask_map_rejects_bad_tiling():

    mask = torch.ones(4, 3, dtype=torch.bool)
    for bad in (MaskMapTiling(0, 1, 1), MaskMapTiling(4, 1, 0), MaskMapTiling(4, 3, 1)):
        with pytest.raises(ValueError, match="map tiling"):
            mask_map_triton(mask, 12, 1, bad)


def test_fp8_merge_tiles():
    assert T.fp8_merge_tile(1100) == (1024, 2, "evict_first")
    assert T.fp8_merge_tile(4096) == (4096, 8, "")


@pytest.mark.parametrize("recipe", [
    "pertensor-e4m3", "pertensor-e5m2", "blockwise-e4m3", "blockwise-e5m2", "mx-e4m3", "mx-e5m2",
])
@pytest.mark.parametrize("h", [17, 300, 1100])  # 1100: 1024-column tiles, evict-first
def test_unpermute_fp8_kernel_dequantizes_in_place(kdevice, poisoned_empty, recipe, h):
    import qmoe
    from qmoe.ops.fp8 import bits_of, scale_layout
    from tests.tensors.helpers import RECIPES

    t, e, k = 29, 8, 3
    ids, mask = routing(t, e, k, "sentinels", kdevice)
    n = int(mask.sum()) + 3
    rid, _ = make_row_id_map(mask, n, False, 1)
    x = torch.randn(n, h, device=kdevice) * torch.logspace(-3, 3, n, device=kdevice)[:, None]
    q = qmoe.quantize(x, RECIPES[recipe])
    w = torch.rand(t, e, device=kdevice)
    args = (bits_of(q), q.raw_scale, scale_layout(q), q.block_size or 0, q.fp8_dtype, rid)
    for weights in (None, w):
        got = KU.unpermute_fp8_triton(*args, weights, torch.float32)
        # The same merge of the dequantized rows on the CPU (in row order).
        want = TI.unpermute_rows(q.dequantize(torch.float32).cpu(), rid.cpu(),
                                None if weights is None else weights.cpu())
        if kdevice == "cpu":
            assert_same_bits(got.cpu(), want)
        else:  # the GPU contracts x * s (* w) + acc to FMAs: bound the error against fp64
            deq = q.dequantize(torch.float64).cpu()
            wd = None if weights is None else weights.double().cpu()
            ref = merge_fp64(deq, rid, wd)
            mag = merge_fp64(deq.abs(), rid, wd)
            err = (got.cpu().double() - ref).abs()
            # dequantize, weight and k adds, each within half an fp32 ulp of its result
            assert (err <= (k + 2) * 2.0**-24 * mag).all(), float((err / mag).nan_to_num().max())


def _merge_case(dev, fp8, bad):
    """A merge given rows cut short (``bad='rows'``) or none (``'empty'``), NaN weights
    (``'nan'``), weights of
    one column or none (``'cols'``, ``'nocols'``) or valid inputs (``None``)."""
    import qmoe
    from qmoe.ops.fp8 import bits_of, scale_layout

    t, e, k, h = 20, 8, 2, 64
    _, mask = routing(t, e, k, "random", dev)
    n = int(mask.sum())
    rid, _ = make_row_id_map(mask, n, False, 1)
    w = torch.rand(t, e, device=dev)
    x = torch.randn(n, h, device=dev)
    if bad == "rows":
        x = x[: n - 3]
    elif bad == "empty":  # no rows at all, yet routes in the map
        x = x[:0]
    elif bad == "nan":
        w = w.index_fill(1, torch.tensor([3], device=dev), float("nan"))
    elif bad == "cols":  # fewer probs columns than the map's experts
        w = w[:, :1].contiguous()
    elif bad == "nocols":
        w = w[:, :0]
    if not fp8:
        return KU.unpermute_rows_triton(x, rid, w)
    q = qmoe.quantize(x, qmoe.MXFP8())
    return KU.unpermute_fp8_triton(bits_of(q), q.raw_scale, scale_layout(q), 32, q.fp8_dtype, rid,
                                w, torch.float32)


_CHILD = """
import sys, torch
from tests.ops.test_kernels import _merge_case
_merge_case("cuda", sys.argv[1] == "1", sys.argv[2])
torch.cuda.synchronize()
print("no error")
"""


@pytest.mark.parametrize("fp8", [False, True])
def test_merge_kernels_refuse_rows_past_inp_and_nan_weights(kdevice, fp8,
                                                            interpreter_asserts):
    """The merge kernels never read past inp or the weights: a map pointing beyond inp
    (inp cut short, or empty), a NaN among the weights they use, or a probs column past
    the weights (one column, or none) trips their device-side assert (``check_routes``).
    On CUDA it ends the CUDA context, so each bad case runs in a child process; under the
    interpreter it raises (InterpreterError around the AssertionError)."""
    msg = "row_id_map points past the rows of inp"
    _merge_case(kdevice, fp8, None)  # fine as given
    for bad in ("rows", "empty", "nan", "cols", "nocols"):
        if kdevice == "cpu":
            from triton.runtime.errors import InterpreterError

            with pytest.raises(InterpreterError, match=msg):  # the interpreter's AssertionError
                _merge_case(kdevice, fp8, bad)
            continue
        r = subprocess.run([sys.executable, "-c", _CHILD, str(int(fp8)), bad],
                           capture_output=True, text=True, timeout=300,
                           cwd=Path(__file__).parents[2])
        assert r.returncode != 0 and "no error" not in r.stdout, (bad, r.stdout, r.stderr[-2000:])
        assert msg in r.stdout + r.stderr, (bad, r.stdout[-2000:], r.stderr[-4000:])


def _permute_probs_case(dev, path, bad):
    """A permute with probs through one kernel (``path``: the map-reading scatter, the
    fused mask permute, or either fused quantize-permute), with a NaN in a routed prob
    (``bad='routed'``), only in unrouted ones (``'unrouted'``) or none (``None``). Returns
    the permuted probs and the same call's on probs with the NaN zeroed."""
    from qmoe.ops.kernels.permute_mask import permute_mask_triton
    from qmoe.ops.kernels.quantize_permute import (
        quantize_permute_mask_triton,
        quantize_permute_triton,
    )

    t, e, k, h = 20, 8, 2, 128
    _, mask = routing(t, e, k, "random", dev)
    n = int(mask.sum())
    x = torch.randn(t, h, device=dev)
    probs = torch.rand(t, e, device=dev)
    if bad == "routed":
        probs[tuple(mask.nonzero()[5].tolist())] = float("nan")  # one entry (a list
        # index would select two whole rows)
    elif bad == "unrouted":
        probs[~mask] = float("nan")

    def run(p):
        if path == "scatter":
            rid, fill = make_row_id_map(mask, n, False, 1)
            pp = torch.full((n,), float("nan"), device=dev)
            KP.permute_rows_triton(x, rid, n, probs=p, probs_out=pp, fill=fill)
            return pp
        if path == "mask":
            return permute_mask_triton(x, mask, n, 1, p)[1]
        args = (128, torch.float8_e4m3fn, "amax", None)
        if path == "quantize":
            rid, fill = make_row_id_map(mask, n, False, 1)
            return quantize_permute_triton(x, rid, p, n, *args, fill)[2]
        return quantize_permute_mask_triton(x, mask, n, 1, p, *args)[2]

    return run(probs), run(probs.nan_to_num(0.0))


_PROBS_CHILD = """
import sys, torch
from tests.ops.test_kernels import _permute_probs_case
_permute_probs_case("cuda", sys.argv[1], "routed")
torch.cuda.synchronize()
print("no error")
"""


@pytest.mark.parametrize("path", ["scatter", "mask", "quantize", "quantize_mask"])
def test_permute_kernels_refuse_nan_in_routed_probs(kdevice, path, interpreter_asserts):
    """The permute kernels check the probs they move (``assert_probs_not_nan``, a device assert in
    place of a pass over all of probs): a NaN in a routed entry fails; NaN in unrouted
    entries reaches no output and passes, with the permuted probs bit-identical to those of
    the same probs with the NaN zeroed. On CUDA the failing case runs in a child process
    (a device assert ends the CUDA context)."""
    msg = "probs holds NaN"
    for bad in (None, "unrouted"):
        got, clean = _permute_probs_case(kdevice, path, bad)
        assert torch.equal(got, clean) and not got.isnan().any(), (path, bad)
    if kdevice == "cpu":
        from triton.runtime.errors import InterpreterError

        with pytest.raises(InterpreterError, match=msg):
            _permute_probs_case(kdevice, path, "routed")
        return
    r = subprocess.run([sys.executable, "-c", _PROBS_CHILD, path], capture_output=True,
                       text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert r.returncode != 0 and "no error" not in r.stdout, (path, r.stdout, r.stderr[-2000:])
    assert msg in r.stdout + r.stderr, (path, r.stdout[-2000:], r.stderr[-4000:])

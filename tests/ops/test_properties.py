"""Property tests (hypothesis) of every op against the reference, plain and FP8.

Each example draws T, H, E, K, a routing density (0 and 1 included), dropping or spare
rows, padding and chunk splits with zeros, plus a torch seed for the data, so a
falsifying example printed by hypothesis replays exactly. Budget: the ``qmoe-ci``
profile in tests/conftest.py (a fixed number of examples per test).
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import qmoe
from qmoe.ops import reference as R
from tests.tensors.helpers import RECIPES, assert_same_bits, assert_same_quantized

DEV = "cuda" if torch.cuda.is_available() else "cpu"
RECIPE = st.sampled_from([None, "pertensor-e4m3", "blockwise-e5m2", "mx-e4m3"])


@st.composite
def routings(draw):
    """(x [T, H] fp32, ids [T, K] with -1s, mask [T, E], probs [T, E], generator seed)."""
    t = draw(st.integers(0, 70))
    e = draw(st.integers(1, 12))
    k = draw(st.integers(1, min(e, 4)))
    h = draw(st.sampled_from([1, 17, 32, 64, 160]))
    density = draw(st.sampled_from([0.0, 0.3, 0.8, 1.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(t, e, generator=g).argsort(dim=1)[:, :k]
    ids = torch.where(torch.rand(t, k, generator=g) < density, ids, -1)
    if draw(st.booleans()) and t:  # one expert takes every routed token
        ids = torch.where(ids >= 0, e - 1, -1)[:, :1].expand(t, k).contiguous()
        ids[:, 1:] = -1
    mask = torch.zeros(t, e + 1, dtype=torch.bool).scatter_(1, torch.where(ids >= 0, ids, e), True)
    x = torch.randn(t, h, generator=g) * 4
    probs = torch.rand(t, e, generator=g)
    return x.to(DEV), ids.to(DEV), mask[:, :e].contiguous().to(DEV), probs.to(DEV), seed


def _inp(x, recipe):
    return x if recipe is None else qmoe.quantize(x, RECIPES[recipe])


def _rows(t):
    """What row movement is checked on: the tensor itself, or (qdata, raw_scale)."""
    return (t,) if not isinstance(t, qmoe.QuantizedTensor) else (t.qdata, t.raw_scale)


@given(r=routings(), extra=st.integers(-8, 5), recipe=RECIPE)
def test_permute_matches_reference_and_maps_agree(r, extra, recipe):
    x, ids, mask, probs, _ = r
    routed = int(mask.sum())
    n = max(0, routed + extra)
    inp = _inp(x, recipe)
    out_m, pp_m, rid_m = qmoe.moe_permute_with_probs(inp, probs, mask, n)
    out_i, rid_i = qmoe.moe_permute(inp, ids, n, map_type="index")
    assert tuple(out_m.shape) == (n, x.shape[1])
    if recipe is None:
        want, pp_want, _ = R.permute(x, mask, "mask", n, probs)
        assert_same_bits(out_m.cpu(), want)
        assert_same_bits(pp_m.cpu(), pp_want)
        assert_same_bits(out_i, out_m)
    else:
        assert_same_quantized(out_i, out_m)
        if recipe.startswith("pertensor"):
            assert_same_bits(out_m.raw_scale, inp.raw_scale)
        # Rows (qdata bytes and scale rows) move exactly as the reference moves rows;
        # unwritten rows are zero bytes with a scale that dequantizes them to 0.
        qd, _, _ = R.permute(inp.qdata.view(torch.uint8), mask, "mask", n)
        assert_same_bits(out_m.qdata.view(torch.uint8).cpu(), qd)
        if not recipe.startswith("pertensor"):
            sc, _, _ = R.permute(inp.raw_scale, mask, "mask", n)
            kept = torch.zeros(n, dtype=torch.bool)
            kept[: min(n, routed)] = True
            assert_same_bits(out_m.raw_scale.cpu()[kept], sc[kept])
        assert (out_m.dequantize(torch.float32)[min(n, routed):] == 0).all()


@given(r=routings(), extra=st.integers(-8, 5), weighted=st.booleans(), recipe=RECIPE)
def test_permute_then_unpermute_counts_routes(r, extra, weighted, recipe):
    """Without probs, unpermute(permute(x)) is x times the token's kept routes; with
    merging probs it is the fp64 reference merge (fp32 accumulation)."""
    x, ids, mask, probs, _ = r
    n = max(0, int(mask.sum()) + extra)
    inp = _inp(x, recipe)
    for rm, mt in ((mask, "mask"), (ids, "index")):
        out, rid = qmoe.moe_permute(inp, rm, n, map_type=mt)
        w = (probs if mt == "mask" else probs.gather(1, ids.clamp(min=0))) if weighted else None
        got = qmoe.moe_unpermute(out, rid, w, map_type=mt)
        assert got.dtype == torch.float32 and tuple(got.shape) == tuple(x.shape)
        xd = x if recipe is None else inp.dequantize(torch.float32)
        ref = R.unpermute(R.permute(xd, rm, mt, n)[0], rm, mt, w, n)
        mag = R.unpermute(R.permute(xd.abs(), rm, mt, n)[0], rm, mt,
                          None if w is None else w.abs(), n)
        err = (got.cpu().double() - ref).abs()
        assert (err <= 8 * 2.0**-24 * mag).all()
        if not weighted and recipe is None:
            kept = rid[:, -1].cpu().double()  # each token's kept routes
            torch.testing.assert_close(got.cpu().double(), x.cpu().double() * kept[:, None],
                                       rtol=4 * 2.0**-24, atol=0)


@given(r=routings(), align=st.sampled_from([1, 4, 16, 32]), recipe=RECIPE,
       spare=st.integers(-12, 12))
def test_pad_variant_both_forms(r, align, recipe, spare):
    """TransformerEngine's form (N counted, one sync) and the sync-free form (N = the
    padded total + spare: rows past the total zero, routes past N dropped), each against
    the reference; FP8 padding and spare rows dequantize to exact zeros."""
    x, ids, mask, probs, _ = r
    inp = _inp(x, recipe)
    tpe = mask.sum(0)
    rows = x if recipe is None else inp.qdata.view(torch.uint8)
    out, pp, rid, pad_offsets, target = qmoe.moe_permute_and_pad_with_probs(
        inp, probs, mask, tpe, align)
    assert int(target.sum()) == out.shape[0] and (target % align == 0).all()
    bound = max(0, out.shape[0] + spare)
    out_b, pp_b, _, po_b, target_b = qmoe.moe_permute_and_pad_with_probs(
        inp, probs, mask, tpe, align, num_out_tokens=bound)
    assert isinstance(po_b, torch.Tensor) and torch.equal(target_b, target)
    for got, got_p, n in ((out, pp, None), (out_b, pp_b, bound)):
        want, pp_want, pos = R.permute(rows, mask, "mask", n, probs, align_size=align)
        got_rows = got if recipe is None else got.qdata.view(torch.uint8)
        assert_same_bits(got_rows.cpu(), want)
        assert_same_bits(got_p.cpu(), pp_want)
        if recipe is not None:  # rows no route fills (padding, spare) dequantize to zeros
            filled = torch.zeros(got.shape[0], dtype=torch.bool)
            filled[[p for p in pos if p >= 0]] = True
            assert not got.dequantize()[~filled.to(got.device)].float().any()


@st.composite
def chunk_splits(draw):
    c = draw(st.integers(1, 9))
    sizes = draw(st.lists(st.sampled_from([0, 0, 1, 3, 7]), min_size=c, max_size=c))
    spare = draw(st.integers(0, 4))
    perm = draw(st.permutations(list(range(c))))
    return sizes, spare, perm


@given(split=chunk_splits(), h=st.sampled_from([1, 17, 64]), recipe=RECIPE,
       seed=st.integers(0, 2**31 - 1))
def test_sort_chunks_and_inverse_is_identity(split, h, recipe, seed):
    sizes, spare, perm = split
    g = torch.Generator().manual_seed(seed)
    rows = sum(sizes) + spare
    x = (torch.randn(rows, h, generator=g) * 3).to(DEV)
    p = torch.rand(rows, generator=g).to(DEV)
    inp = _inp(x, recipe)
    s = torch.tensor(sizes, device=DEV)
    order = torch.tensor(perm, device=DEV)
    out, pp = qmoe.moe_sort_chunks_by_index_with_probs(inp, p, s, order)
    for got, src in zip(_rows(out), _rows(inp)):
        if got.dim() == 2:
            assert_same_bits(got.cpu(), R.sort_chunks(src.cpu(), sizes, perm)[0])
    assert_same_bits(pp.cpu(), R.sort_chunks(x.cpu(), sizes, perm, p.cpu())[1])
    # The inverse: the sorted chunks, split by their new sizes, put back in place.
    inv = torch.empty_like(order)
    inv[order] = torch.arange(len(perm), device=DEV)
    back, pb = qmoe.moe_sort_chunks_by_index_with_probs(out, pp, s[order], inv)
    for a, b in zip(_rows(back), _rows(inp)):
        assert_same_bits(a, b)
    assert_same_bits(pb, p)


pytestmark = pytest.mark.filterwarnings("error")

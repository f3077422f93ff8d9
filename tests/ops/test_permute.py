"""Permute / unpermute / pad against the pure-torch reference (CPU path; the GPU runs
the same tests through the Triton kernels)."""

import pytest
import torch

import qmoe
from qmoe.ops import reference as R
from tests.ops.helpers import KINDS, assert_bf16_merge, routing
from tests.tensors.helpers import assert_same_bits

DEV = "cuda" if torch.cuda.is_available() else "cpu"

SHAPES = [  # (T, H, E, K)
    (1, 17, 4, 2), (63, 1, 7, 3), (64, 130, 8, 1), (33, 17, 7, 7), (20, 64, 256, 8),
    (9, 40, 1024, 4), (1025, 32, 16, 4), (5, 7168, 8, 2),
]


def _inputs(t, h, e, k, kind, dtype=torch.bfloat16):
    x = torch.randn(t, h, dtype=dtype, device=DEV)
    ids, mask = routing(t, e, k, kind, DEV)
    return x, ids, mask


@pytest.mark.parametrize("t,h,e,k", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
def test_permute_mask_and_index_match_reference(t, h, e, k, kind):
    x, ids, mask = _inputs(t, h, e, k, kind)
    ref, _, _ = R.permute(x.cpu(), mask.cpu(), "mask")
    out_m, rid_m = qmoe.moe_permute(x, mask)
    out_i, rid_i = qmoe.moe_permute(x, ids, map_type="index", num_experts=e)
    assert out_m.dtype == x.dtype and out_m.device == x.device
    assert_same_bits(out_m.cpu(), ref)
    assert_same_bits(out_i.cpu(), ref)
    assert rid_m.shape == (t, 2 * e + 1) and rid_i.shape == (t, 2 * ids.shape[1] + 1)


@pytest.mark.parametrize("t,h,e,k", [(63, 17, 8, 3), (1025, 64, 16, 4)])
@pytest.mark.parametrize("map_type", ["mask", "index"])
@pytest.mark.parametrize("extra", [-40, -1, 0, 5])
def test_fixed_num_out_tokens_drops_and_pads(t, h, e, k, map_type, extra):
    x, ids, mask = _inputs(t, h, e, k, "sentinels")
    rm = mask if map_type == "mask" else ids
    routed = int(mask.sum())
    n = max(0, routed + extra)
    probs = torch.rand(t, rm.shape[1], device=DEV)
    out, pp, rid = qmoe.moe_permute_with_probs(x, probs, rm, n, map_type=map_type)
    ref, rpp, _ = R.permute(x.cpu(), rm.cpu(), map_type, n, probs.cpu())
    assert out.shape == (n, h) and pp.shape == (n,)
    assert_same_bits(out.cpu(), ref)
    assert_same_bits(pp.cpu(), rpp)
    # Unpermute treats dropped routes as absent.
    w = torch.rand(t, rm.shape[1], device=DEV)
    y = qmoe.moe_unpermute(out, rid, merging_probs=w, map_type=map_type)
    assert_bf16_merge(y, out, rm, map_type, w, n)  # bf16 output, fp32 accumulation


@pytest.mark.parametrize("t,h,e,k", SHAPES)
@pytest.mark.parametrize("map_type", ["mask", "index"])
@pytest.mark.parametrize("with_probs", [False, True])
def test_unpermute_fp32_against_fp64(t, h, e, k, map_type, with_probs):
    x, ids, mask = _inputs(t, h, e, k, "sentinels", torch.float32)
    rm = mask if map_type == "mask" else ids
    out, rid = qmoe.moe_permute(x, rm, map_type=map_type)
    y_in = torch.randn_like(out)  # what the experts returned
    w = torch.rand(t, rm.shape[1], device=DEV) if with_probs else None
    y = qmoe.moe_unpermute(y_in, rid, w, map_type=map_type)
    ref = R.unpermute(y_in.cpu(), rm.cpu(), map_type, None if w is None else w.cpu())
    assert y.dtype == torch.float32 and y.shape == (t, h)
    err = (y.double().cpu() - ref).abs().max().item() if y.numel() else 0.0
    scale = ref.abs().max().item() if ref.numel() else 1.0
    assert err <= 1e-6 * max(scale, 1.0) * max(k, 1)


def test_mask_and_index_merge_identically():
    x, ids, mask = _inputs(257, 96, 16, 4, "random", torch.float32)
    w_e = torch.rand(257, 16, device=DEV)
    w_k = w_e.gather(1, ids)
    out_m, rid_m = qmoe.moe_permute(x, mask)
    out_i, rid_i = qmoe.moe_permute(x, ids, map_type="index")
    y_m = qmoe.moe_unpermute(out_m * 3, rid_m, w_e)
    y_i = qmoe.moe_unpermute(out_i * 3, rid_i, w_k, map_type="index")
    assert torch.equal(y_m, y_i)


def test_permute_then_unpermute_counts_routes():
    x, ids, mask = _inputs(100, 32, 8, 3, "no_route_tokens", torch.float32)
    out, rid = qmoe.moe_permute(x, mask)
    back = qmoe.moe_unpermute(out, rid)
    assert torch.equal(back, x * mask.sum(1, keepdim=True).to(x.dtype))


@pytest.mark.parametrize("align", [1, 4, 16, 128])
@pytest.mark.parametrize("kind", ["random", "empty_experts", "one_expert"])
def test_pad_variant_matches_reference(align, kind):
    t, h, e, k = 70, 48, 8, 2
    x, ids, mask = _inputs(t, h, e, k, kind)
    probs = torch.rand(t, e, device=DEV)
    tpe = mask.sum(0)
    out, pp, rid, pad_offsets, target = qmoe.moe_permute_and_pad_with_probs(
        x, probs, mask, tpe, align
    )
    ref, rpp, _ = R.permute(x.cpu(), mask.cpu(), "mask", None, probs.cpu(), align_size=align)
    assert_same_bits(out.cpu(), ref)
    assert_same_bits(pp.cpu(), rpp)
    want_target = (tpe + align - 1) // align * align
    assert torch.equal(target.cpu(), want_target.cpu())
    pads = want_target - tpe
    if bool(pads.any()):
        assert torch.equal(pad_offsets.cpu(), (torch.cumsum(pads, 0) - pads).cpu())
    else:
        assert pad_offsets is None
    y = qmoe.moe_unpermute(out.float(), rid, probs, pad_offsets=pad_offsets)
    ry = R.unpermute(out.float().cpu(), mask.cpu(), "mask", probs.cpu(), align_size=align)
    torch.testing.assert_close(y.double().cpu(), ry, rtol=1e-5, atol=1e-5)

    # The sync-free form with a bound: same rows, zero tail, always a pad_offsets tensor.
    bound = int(target.sum()) + 7
    out2, pp2, rid2, po2, target2 = qmoe.moe_permute_and_pad_with_probs(
        x, probs, mask, None, align, num_out_tokens=bound
    )
    assert out2.shape == (bound, h)
    assert_same_bits(out2[: ref.shape[0]].cpu(), ref)
    assert not out2[ref.shape[0]:].float().any()
    assert isinstance(po2, torch.Tensor) and torch.equal(target2, target)

    # num_out_tokens=-1 is the syncing form, as None: same pad_offsets, same check
    out3, _, _, po3, _ = qmoe.moe_permute_and_pad_with_probs(x, probs, mask, tpe, align,
                                                             num_out_tokens=-1)
    assert_same_bits(out3.cpu(), ref)
    assert (po3 is None) == (pad_offsets is None)
    with pytest.raises(ValueError, match="tokens_per_expert does not match"):
        qmoe.moe_permute_and_pad_with_probs(x, probs, mask, tpe + 1, align, num_out_tokens=-1)


def test_empty_inputs():
    x = torch.randn(0, 16, device=DEV)
    mask = torch.zeros(0, 4, dtype=torch.bool, device=DEV)
    out, rid = qmoe.moe_permute(x, mask)
    assert out.shape == (0, 16) and rid.shape == (0, 9)
    assert qmoe.moe_unpermute(out, rid).shape == (0, 16)
    ids = torch.zeros(0, 2, dtype=torch.long, device=DEV)
    out, rid = qmoe.moe_permute(x, ids, map_type="index")
    assert out.shape == (0, 16)
    out, rid = qmoe.moe_permute(x, mask, num_out_tokens=5)  # no tokens, fixed buffer
    assert out.shape == (5, 16) and not out.any()
    nothing = torch.zeros(3, 4, dtype=torch.bool, device=DEV)
    out, rid = qmoe.moe_permute(torch.randn(3, 16, device=DEV), nothing)
    assert out.shape == (0, 16)
    merged = qmoe.moe_unpermute(out, rid)
    assert merged.shape == (3, 16) and not merged.any()


@pytest.mark.parametrize("layout", ["row_stride", "column_major", "every_other_row"])
def test_strided_input(layout):
    """Strided inp, probs and maps through every public op, both map types: the same bits
    (merges: the same values) as their contiguous copies."""
    t, h, e, k = 50, 64, 8, 2
    base = torch.randn(2 * t, 96, device=DEV)
    x = {"row_stride": base[:t, 8:72], "column_major": base[:t, :h].t().contiguous().t(),
         "every_other_row": base[::2, :h]}[layout]
    assert not x.is_contiguous()
    ids, mask = routing(t, e, k, "random", DEV)
    probs = torch.rand(e, t, device=DEV).t()  # column-major probs
    for rm, map_type, p in ((mask, "mask", probs), (ids, "index", probs[:, :k])):
        ref, _, _ = R.permute(x.contiguous().cpu(), rm.cpu(), map_type)
        out, pp, rid = qmoe.moe_permute_with_probs(x, p, rm, map_type=map_type)
        assert_same_bits(out.cpu(), ref)
        out_c, pp_c, _ = qmoe.moe_permute_with_probs(x.contiguous(), p.contiguous(), rm,
                                                     map_type=map_type)
        assert_same_bits(pp, pp_c)
        y_src = torch.randn(out.shape[1], out.shape[0], device=DEV).t()  # strided merge inp
        assert_same_bits(qmoe.moe_unpermute(y_src, rid, p, map_type=map_type),
                         qmoe.moe_unpermute(y_src.contiguous(), rid, p.contiguous(),
                                            map_type=map_type))
    sizes, order = torch.tensor([20, 0, 30], device=DEV), torch.tensor([2, 0, 1], device=DEV)
    assert_same_bits(qmoe.moe_sort_chunks_by_index(x, sizes, order),
                     qmoe.moe_sort_chunks_by_index(x.contiguous(), sizes, order))


@pytest.mark.parametrize("name", ["blockwise-e4m3", "mx-e5m2", "pertensor-e4m3"])
def test_strided_quantized_input(name):
    """Row views of quantized tensors (every other row; a block-aligned column slice)
    permute as their clones do."""
    from tests.tensors.helpers import RECIPES, assert_same_quantized

    t, e, k = 40, 8, 2
    q = qmoe.quantize(torch.randn(2 * t, 512, device=DEV), RECIPES[name])
    ids, mask = routing(t, e, k, "random", DEV)
    for view in (q[::2], q[:t, 128:384]):
        for rm, map_type in ((mask, "mask"), (ids, "index")):
            got, _ = qmoe.moe_permute(view, rm, t * k, map_type=map_type)
            want, _ = qmoe.moe_permute(view.clone(), rm, t * k, map_type=map_type)
            assert_same_quantized(got, want)


def test_integer_mask_and_int32_and_uint8_ids():
    x, ids, mask = _inputs(40, 16, 6, 2, "random")
    b, _ = qmoe.moe_permute(x, ids.to(torch.int32), map_type="index")
    c, _ = qmoe.moe_permute(x, mask)
    assert_same_bits(b, c)
    for dt in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        for n in (None, 40 * 2):  # the syncing and the sync-free form
            assert_same_bits(qmoe.moe_permute(x, mask.to(dt), n)[0][: int(mask.sum())], c)
    # uint8 expert ids (no -1 fits), as TransformerEngine accepts them: the same rows and map
    d, rd = qmoe.moe_permute(x, ids.to(torch.uint8), map_type="index")
    _, r64 = qmoe.moe_permute(x, ids, map_type="index")
    assert_same_bits(d, c)
    assert torch.equal(rd, r64)


@pytest.mark.parametrize("map_type", ["mask", "index"])
def test_no_experts_with_merging_probs(map_type):
    """E = 0 (mask) / K = 0 (index): the permute gives no rows, and unpermute with the
    [T, 0] merging probs it accepted gives zeros (it had refused them), forward and back."""
    x = torch.randn(3, 4, device=DEV, requires_grad=True)
    p = torch.rand(3, 0, device=DEV, requires_grad=True)
    rm = (torch.zeros(3, 0, dtype=torch.bool, device=DEV) if map_type == "mask"
          else torch.zeros(3, 0, dtype=torch.long, device=DEV))
    out, pp, rid = qmoe.moe_permute_with_probs(x, p, rm, map_type=map_type)
    assert out.shape == (0, 4) and pp.shape == (0,)
    y = qmoe.moe_unpermute(out, rid, p, map_type=map_type)
    assert torch.equal(y, torch.zeros(3, 4, device=DEV))
    y.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x)) and p.grad.shape == (3, 0)


def test_small_integer_ids_with_bounds_past_their_dtype():
    """int8 / int16 / uint8 index maps on the sync-free path, with ``num_experts`` past what
    their dtype holds: the id checks compare in int64 (in the map's dtype 2**31 - 1 and E
    wrapped, and valid maps raised). The rows and map equal the int64 map's."""
    t, h, e, k = 37, 8, 6, 2
    x, ids, _ = _inputs(t, h, e, k, "random")
    ids[3, 1] = -1  # a dropped route (not for uint8, which holds no -1)
    ids[0, 0] = e - 1  # the largest id occurs (the num_experts=5 case below must raise)
    want, rwant = qmoe.moe_permute(x, ids, t * k, map_type="index")
    for dt in (torch.int8, torch.int16, torch.uint8):
        m = ids.clamp(min=0) if dt == torch.uint8 else ids
        ref, rref = qmoe.moe_permute(x, m, t * k, map_type="index")
        for ne in (None, 300, 40000):
            got, rid = qmoe.moe_permute(x, m.to(dt), t * k, map_type="index", num_experts=ne)
            assert_same_bits(got, ref)
            assert torch.equal(rid, rref)
    assert_same_bits(qmoe.moe_permute(x, ids.to(torch.int8), t * k, map_type="index")[0], want)
    if DEV == "cpu":  # on CUDA a device assert, which ends the CUDA context (one runs in a
        # child process: test_compile_ops.py::test_bad_input_under_compile)
        with pytest.raises(ValueError, match="num_experts=5"):
            qmoe.moe_permute(x, ids.to(torch.int8), t * k, map_type="index", num_experts=5)


def test_megatron_call_patterns():
    """Calls TransformerEngine accepts and Megatron-LM makes: fp64 router probs (their
    permuted probs and gradients stay fp64), ``num_out_tokens`` as a 0-d integer tensor or a
    numpy int, and the pad variant's ``tokens_per_expert`` built on the CPU."""
    np = pytest.importorskip("numpy")
    t, h, e, k = 45, 24, 8, 3
    x, ids, mask = _inputs(t, h, e, k, "random", torch.float32)
    probs = torch.rand(t, e, dtype=torch.float64, device=DEV).requires_grad_()
    n = int(mask.sum())
    for num in (torch.tensor(n - 5, device=DEV), np.int64(n - 5), mask.sum() - 5):
        out, pp, rid = qmoe.moe_permute_with_probs(x, probs, mask, num)
        ref, rpp, _ = R.permute(x.cpu(), mask.cpu(), "mask", n - 5, probs.detach().cpu())
        assert pp.dtype == torch.float64
        assert_same_bits(out.cpu(), ref)
        assert_same_bits(pp.detach().cpu(), rpp)
    y = qmoe.moe_unpermute(out, rid, merging_probs=probs)
    (y.sum() + pp.sum()).backward()
    assert probs.grad.dtype == torch.float64 and probs.grad.shape == (t, e)
    # index map with fp64 probs
    p_k = probs.detach().gather(1, ids)
    out_i, pp_i, _ = qmoe.moe_permute_with_probs(x, p_k, ids, map_type="index")
    assert torch.equal(pp_i, R.permute(x.cpu(), mask.cpu(), "mask", None,
                                       probs.detach().cpu())[1].to(DEV))
    # pad variant: tokens_per_expert on the CPU whatever inp's device
    tpe = mask.sum(0).cpu()
    out_p, pp_p, *_ = qmoe.moe_permute_and_pad_with_probs(x, probs.detach(), mask, tpe, 16)
    ref_p, rpp_p, _ = R.permute(x.cpu(), mask.cpu(), "mask", None, probs.detach().cpu(),
                                align_size=16)
    assert_same_bits(out_p.cpu(), ref_p)
    assert_same_bits(pp_p.cpu(), rpp_p)
    # chunk sort with fp64 probs
    sizes = torch.tensor([10, 0, 30, 5], device=DEV)
    order = torch.tensor([2, 3, 0, 1], device=DEV)
    sp = torch.rand(t, dtype=torch.float64, device=DEV)
    _, sp_out = qmoe.moe_sort_chunks_by_index_with_probs(x, sp, sizes, order)
    assert torch.equal(sp_out.cpu(), R.sort_chunks(x.cpu(), [10, 0, 30, 5], [2, 3, 0, 1],
                                                   sp.cpu())[1])


@pytest.mark.parametrize("map_type", ["mask", "index", "pad"])
def test_nan_probs_matter_only_at_kept_routes(map_type):
    """One rule on every device: the probs (and merging probs) of kept routes must not be
    NaN; entries of unrouted slots and dropped routes may hold anything, as
    TransformerEngine's tests build them (0/0 = NaN for tokens with no route). The
    refusal of a NaN at a kept route is a ValueError on CPU (a device assert on CUDA,
    tested in test_kernels)."""
    t, h, e, k = 37, 24, 6, 2
    x, ids, mask = _inputs(t, h, e, k, "no_route_tokens")
    rm = ids if map_type == "index" else mask
    n = int(mask.sum()) - 5  # a few dropped routes
    clean = torch.rand(t, rm.shape[1], device=DEV)

    def permute(p):
        if map_type == "pad":
            out, pp, rid, _, _ = qmoe.moe_permute_and_pad_with_probs(x, p, rm, None, 4,
                                                                      num_out_tokens=n)
            return out, pp, rid
        return qmoe.moe_permute_with_probs(x, p, rm, n, map_type="index" if map_type ==
                                           "index" else "mask")

    out, pp, rid = permute(clean)
    s = (rid.shape[1] - 1) // 2
    kept = torch.arange(s, device=DEV) < rid[:, 2 * s :]
    p = clean.shape[1]  # unkept slots write a scratch column
    cols = torch.where(kept, rid[:, s : 2 * s], p).long()
    kept_entries = torch.zeros(t, p + 1, dtype=torch.bool, device=DEV).scatter_(
        1, cols, True)[:, :p]
    assert (~kept_entries).any() and (rm != (-1 if map_type == "index" else 0)).sum() > (
        kept_entries.sum())  # unrouted and dropped entries both exist
    dirty = torch.where(kept_entries, clean, float("nan"))
    got = permute(dirty)
    for a, b in zip(got, (out, pp, rid)):
        assert_same_bits(a, b)
    y = torch.randn_like(out)
    assert_same_bits(qmoe.moe_unpermute(y, rid, dirty), qmoe.moe_unpermute(y, rid, clean))
    if DEV == "cuda":
        return
    one = dirty.clone()
    r, c = kept_entries.nonzero()[len(kept_entries.nonzero()) // 2]
    one[r, c] = float("nan")
    with pytest.raises(ValueError, match="probs holds NaN at a kept route"):
        permute(one)
    with pytest.raises(ValueError, match="moe_unpermute: merging_probs holds NaN at a kept"):
        qmoe.moe_unpermute(y, rid, one)

"""The C++ CPU kernels (qmoe._C, from csrc/) against the vectorized torch path: bit for bit
for data movement and quantization, fp64 for merges. Skipped when built with
QMOE_SKIP_CPP_BUILD=1 (CI runs the suite both ways)."""

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qmoe
from qmoe._backends import cpp_loaded
from qmoe.ops import torch_impl as TI
from qmoe.ops.row_id_map import _index_rows, _mask_rows, fill_rows
from qmoe.ops.sort_chunks import chunk_source_rows
from qmoe.tensors.quantize import _reference_blocks, _saturate_cast
from tests.ops.helpers import KINDS, routing
from tests.tensors.helpers import assert_same_bits

pytestmark = pytest.mark.skipif(
    not cpp_loaded(), reason="built without csrc/ (QMOE_SKIP_CPP_BUILD=1)"
)
ops = torch.ops.qmoe


def test_backends_report():
    assert qmoe.backends()["cpu"].startswith("c++")


@pytest.mark.parametrize("t,e,k", [(1, 4, 2), (63, 7, 7), (200, 256, 8), (9, 1024, 4), (0, 4, 2)])
@pytest.mark.parametrize("kind", KINDS)
def test_maps(t, e, k, kind):
    ids, mask = routing(t, e, k, kind)
    for n in (int(mask.sum()), int(mask.sum()) // 2, int(mask.sum()) + 5):
        for align in (1, 8):
            got, fill = ops.make_row_id_map(mask, n, False, align)
            assert torch.equal(got, _mask_rows(mask, n, align))
            assert torch.equal(fill, fill_rows(mask.sum(0) if align > 1 else mask.sum(), n,
                                               align))
        got, fill = ops.make_row_id_map(mask.int(), n, False, 1)
        assert torch.equal(got, _mask_rows(mask, n, 1))
        assert torch.equal(fill, fill_rows(mask.sum(), n, 1))
        got, fill = ops.make_row_id_map(ids, n, True, 1)
        assert torch.equal(got, _index_rows(ids, n))
        assert torch.equal(fill, fill_rows((ids >= 0).sum(), n, 1))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_index_map_sparse_huge_ids(dtype):
    """Ids far past T*K without num_experts (the largest near the dtype's max): the map takes
    a sort instead of a counting array of max(id) + 1 entries (was std::bad_alloc)."""
    t, k = 50, 3
    ids, _ = routing(t, 9, k, "sentinels")
    big = torch.iinfo(dtype).max - 8
    sparse = torch.where(ids >= 0, ids.long() * (big // 8), ids.long()).to(dtype)
    assert int(sparse.max()) > 4 * t * k + 4096
    for n in (int((ids >= 0).sum()), 40, int((ids >= 0).sum()) + 3):
        got, fill = ops.make_row_id_map(sparse, n, True, 1)
        # the same order as the compact ids (the map is rank-based)
        assert torch.equal(got, _index_rows(ids, n))
        assert torch.equal(fill, fill_rows((ids >= 0).sum(), n, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "t,h,e,k,extra",
    # H = 2112: rows of a multiple of 64 bytes (the permute's streaming-store copy) and
    # merges that step over more than one 1024-column chunk
    [(63, 17, 7, 3, 0), (100, 300, 16, 4, -30), (5, 1, 4, 4, 6), (40, 2112, 8, 3, 5)],
)
@pytest.mark.parametrize("offset", [0, 3], ids=["aligned", "misaligned_rows"])
def test_move_and_merge(dtype, t, h, e, k, extra, offset):
    ids, mask = routing(t, e, k, "sentinels")
    n = max(0, int(mask.sum()) + extra)
    rid = _mask_rows(mask, n, 1)
    # offset 3: rows start 3 elements into a wider buffer (not 16-byte aligned)
    x = torch.randn(t, h + offset).to(dtype)[:, offset:]
    probs = torch.rand(t, e)
    out, pp = ops.permute(x, rid, probs, n)
    assert_same_bits(out, TI.permute_rows(x, rid, n))
    y = torch.randn(n, h).to(dtype)
    for w in (None, probs):
        assert_same_bits(ops.unpermute(y, rid, w), TI.unpermute_rows(y, rid, w))
    g = torch.randn(t, h).to(dtype)
    gi, gw = ops.unpermute_backward(g, rid, probs, y, n)
    assert_same_bits(gi, TI.permute_rows(g, rid, n, probs))
    tok, row, col = TI.routes(rid)
    prod = g.double()[tok] * y.double()[row]  # [routes, H]
    ref, mag = torch.zeros(2, t, e, dtype=torch.float64)
    ref[tok, col] = prod.sum(1)
    # fp32 sum of h products: |error| <= (h + 1) * 2**-24 * sum |g * y| (rounding of each
    # product and each addition); a fixed atol fails on unlucky draws at h = 2112
    mag[tok, col] = prod.abs().sum(1)
    assert ((gw.double() - ref).abs() <= (h + 1) * 2**-24 * mag + 1e-30).all()


@pytest.mark.parametrize("t,h,e,k,extra", [(1, 128, 4, 2, 0), (63, 17, 7, 3, 5),
                                           (100, 300, 16, 4, -30), (0, 128, 4, 2, 3)])
@pytest.mark.parametrize("with_probs", [False, True])
def test_permute_with_scales(t, h, e, k, extra, with_probs):
    """Quantized rows and their scale rows moved by one map: as two torch-path permutes,
    bit for bit (rows no route writes zero, routes past N dropped)."""
    ids, mask = routing(t, e, k, "sentinels")
    n = max(0, int(mask.sum()) + extra)
    rid = _mask_rows(mask, n, 1)
    bits = torch.randint(0, 256, (t, h), dtype=torch.uint8)
    srows = torch.rand(t, (h + 127) // 128)
    probs = torch.rand(t, e) if with_probs else None
    got_bits, got_s, got_pp = ops.permute_with_scales(bits, srows, rid, probs, n)
    assert_same_bits(got_bits, TI.permute_rows(bits, rid, n))
    assert_same_bits(got_s, TI.permute_rows(srows, rid, n))
    if with_probs:
        assert torch.equal(got_pp, ops.permute(bits, rid, probs, n)[1])
    else:
        assert got_pp.numel() == 0 and got_pp.dtype == bits.dtype
    with pytest.raises(ValueError, match="scale_rows must be"):
        ops.permute_with_scales(bits, torch.rand(t + 1, 1), rid, probs, n)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("recipe", ["pertensor", "blockwise", "mx"])
def test_unpermute_fp8(recipe, fp8):
    from qmoe.ops.fp8 import bits_of, scale_layout

    r = {"pertensor": qmoe.PerTensor(fp8), "blockwise": qmoe.Blockwise(fp8_dtype=fp8),
         "mx": qmoe.MXFP8(fp8)}[recipe]
    t, e = 40, 8
    ids, mask = routing(t, e, 3, "random")
    n = int(mask.sum())
    rid = _mask_rows(mask, n, 1)
    w = torch.rand(t, e)
    for h, weights in itertools.product((200, 2304), (None, w)):  # 2304: two merge chunks+
        q = qmoe.quantize(torch.randn(n, h) * 10, r)
        got = ops.unpermute_fp8(bits_of(q), q.raw_scale, rid, weights, scale_layout(q),
                                q.block_size or 0, q.fp8_dtype, torch.float32)
        want = TI.unpermute_fp8_rows(bits_of(q), q.raw_scale, scale_layout(q), q.block_size or 0,
                                    q.fp8_dtype, rid, weights, torch.float32)
        assert_same_bits(got, want)


@pytest.mark.parametrize("bs", [96, 1500, 2304])
def test_unpermute_fp8_any_block_size(bs):
    """fp32 block scales of any width (torchao's per-row scales are one block of H), blocks
    straddling the merge's 1024-column steps included."""
    from qmoe.ops.fp8 import bits_of

    t, e, h = 30, 6, 2304
    ids, mask = routing(t, e, 2, "random")
    n = int(mask.sum())
    rid = _mask_rows(mask, n, 1)
    q = qmoe.quantize(torch.randn(n, h), qmoe.PerTensor())
    scale = torch.rand(n, -(-h // bs)) + 0.5
    for weights in (None, torch.rand(t, e)):
        got = ops.unpermute_fp8(bits_of(q), scale, rid, weights, 1, bs, q.fp8_dtype, torch.float32)
        want = TI.unpermute_fp8_rows(bits_of(q), scale, 1, bs, q.fp8_dtype, rid, weights,
                                    torch.float32)
        assert_same_bits(got, want)


@pytest.mark.parametrize("probs_dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_map_check_agrees_with_torch(probs_dtype):
    """``qmoe::map_check``: the C++ pass reports the same first fault as the torch kernel,
    for a good map and each kind of corruption (alone and with a later one)."""
    from qmoe.ops.unpermute import _map_check

    t, e, k = 37, 6, 3
    ids, mask = routing(t, e, k, "sentinels")
    n = int(mask.sum())
    rid, _ = ops.make_row_id_map(mask, n, False, 1)
    probs = torch.rand(t, e, dtype=probs_dtype) * mask
    probs[~mask] = float("nan")  # unread entries may hold anything
    s = e
    kept_t, kept_s = (torch.arange(s) < rid[:, 2 * s : 2 * s + 1]).nonzero(as_tuple=True)
    i, j = int(kept_t[len(kept_t) // 2]), int(kept_s[len(kept_s) // 2])

    def bad(kind):
        r, p = rid.clone(), probs.clone()
        if kind == "count":
            r[i, 2 * s] = s + 1
        elif kind == "row":
            r[i, j] = n
        elif kind == "neg_row":
            r[i, j] = -1
        elif kind == "twice":
            r[i, j] = r[int(kept_t[0]), int(kept_s[0])] if i else r[int(kept_t[-1]),
                                                                    int(kept_s[-1])]
        elif kind == "col":
            r[i, s + j] = e
        elif kind == "nan":
            p[i, int(r[i, s + j])] = float("nan")
        return r, p

    want_codes = {None: 0, "count": 1, "row": 2, "neg_row": 2, "twice": 3, "col": 4, "nan": 5}
    for kind, want in want_codes.items():
        r, p = bad(kind) if kind else (rid, probs)
        for w in (p, None):
            got = ops.map_check(r, n, w)
            ref = _map_check.fn(r, n, w)
            assert got.dtype == torch.int32 and got.dim() == 0
            assert int(got) == int(ref), (kind, w is None)
            assert int(got) == (want if (w is not None or want < 4) else 0), (kind, w is None)
    r, p = bad("twice")
    r[i, s + j] = e  # a later fault (a column) does not hide the first
    assert int(ops.map_check(r, n, p)) == int(_map_check.fn(r, n, p)) == 3


@pytest.mark.parametrize("pdtype", [torch.float32, torch.bfloat16, torch.float64])
def test_permute_backward_agrees_with_torch(pdtype):
    """``qmoe::permute_backward`` in C++ against its torch kernel: the merge of the rows'
    gradient and the probs' gradient bit for bit (dropped routes, spare rows)."""
    from qmoe.ops.unpermute import _permute_backward_op

    for t, h, e, k, extra in ((1, 1, 4, 2, 0), (63, 17, 7, 3, -5), (40, 64, 16, 8, 4)):
        ids, mask = routing(t, e, k, "sentinels")
        n = max(0, int(mask.sum()) + extra)
        for rm, is_index in ((mask, False), (ids, True)):
            rid, _ = ops.make_row_id_map(rm, n, is_index, 1)
            g = torch.randn(n, h).to(torch.bfloat16)
            gpp = torch.randn(n).to(pdtype)
            got = ops.permute_backward(g, rid, gpp, rm.shape[1], pdtype)
            want = _permute_backward_op.fn(g, rid, gpp, rm.shape[1], pdtype)
            for a, b in zip(got, want):
                assert_same_bits(a, b)


def test_sort_chunks():
    x = torch.randn(50, 33).to(torch.bfloat16)
    sizes = torch.tensor([7, 0, 20, 13])
    order = torch.tensor([2, 3, 0, 1])
    p = torch.rand(50)
    out, pp = ops.sort_chunks(x, sizes, order, p)
    src = chunk_source_rows(sizes, order, 50)
    assert_same_bits(out, x[src])
    assert_same_bits(pp, p[src])


@pytest.mark.parametrize("t,h", [(50, 33), (1, 128), (0, 128)])
@pytest.mark.parametrize("with_probs", [False, True])
def test_sort_chunks_rows(t, h, with_probs):
    """Rows and their side rows (quantized rows' scales) in one chunk sort: as the rows
    gathered by each chunk's source rows, bit for bit (rows past the chunks stay)."""
    bits = torch.randint(0, 256, (t, h), dtype=torch.uint8)
    side = torch.rand(t, (h + 127) // 128)
    sizes = torch.tensor([7, 0, 20, 13]) if t == 50 else torch.tensor([t, 0])
    order = torch.tensor([2, 3, 0, 1]) if t == 50 else torch.tensor([1, 0])
    p = torch.rand(t) if with_probs else None
    out, side_out, pp = ops.sort_chunks_rows(bits, side, sizes, order, p)
    src = chunk_source_rows(sizes, order, t)
    assert_same_bits(out, bits[src])
    assert_same_bits(side_out, side[src])
    if with_probs:
        assert_same_bits(pp, p[src])
    else:
        assert pp.numel() == 0 and pp.dtype == bits.dtype
    with pytest.raises(ValueError, match="side must be"):
        ops.sort_chunks_rows(bits, torch.rand(t + 1, 1), sizes, order, p)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_conversion_of_every_bf16_and_random_fp32(fp8):
    """The C++ fp32 -> fp8 conversion (branch-free, vectorized) against torch's saturated
    cast: every bf16 bit pattern (both signs, subnormals, inf, NaN payloads) as bf16 and
    as fp32, and a million random fp32 bit patterns, at scale 1 and at a scale that moves
    values across the fp8 subnormal and saturation boundaries; rows of odd length, so the
    vector loops' tails run too."""
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    rand = torch.randint(-(1 << 31), (1 << 31) - 1, (1 << 20,), dtype=torch.int32)
    for x in (every, every.float(), rand.view(torch.float32)):
        x = x[: x.numel() // 1001 * 1001].reshape(-1, 1001)
        for scale in (1.0, 3.0e-3):
            s = torch.tensor(scale)
            assert_same_bits(ops.quantize_with_scale(x, s, fp8),
                             _saturate_cast(x.float() / s, fp8))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("mode,bs", [("amax", 128), ("pow2", 128), ("mx_floor", 32),
                                     ("mx_rceil", 32), ("amax", 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize(fp8, mode, bs, dtype):
    x = torch.randn(9, 300) * torch.logspace(-30, 30, 9)[:, None]
    x[1] = 0
    x[2, 3] = float("nan")
    x[3, 0] = float("inf")
    x = x.to(dtype)
    q, s = ops.quantize_blocks(x, bs, fp8, mode)
    qr, sr = _reference_blocks(x, bs, fp8, mode)
    assert_same_bits(q, qr)
    assert_same_bits(s, sr)
    scale = torch.tensor(0.37)
    assert_same_bits(ops.quantize_with_scale(x, scale, fp8), _saturate_cast(x.float() / scale, fp8))


def test_bad_input_is_an_exception_not_a_crash():
    x = torch.randn(4, 8)
    rid = torch.full((4, 5), -1, dtype=torch.int32)
    rid[:, 4] = 1
    rid[:, 0] = 99  # a row far past N
    with pytest.raises(ValueError, match="out of range"):
        ops.permute(x, rid, None, 3)
    with pytest.raises(ValueError, match="row_id_map must be int32"):
        ops.unpermute(x, rid.long(), None)
    # a row's route count past its S slots: refused before any entry past the row is read
    # (guards against the merge writing per-route weights for that many routes)
    over = torch.full((400, 5), -1, dtype=torch.int32)
    over[:, 4] = 0
    over[0, 4] = 3000
    y = torch.randn(50, 8)
    for call in (lambda: ops.unpermute(y, over, None),
                 lambda: ops.unpermute(y, over, torch.rand(400, 2)),
                 lambda: ops.permute(torch.randn(400, 8), over, None, 50)):
        with pytest.raises(ValueError, match="counts 3000 routes but the map has 2 slots"):
            call()

    with pytest.raises(ValueError, match="sum to at most"):
        ops.sort_chunks(x, torch.tensor([3, 3]), torch.tensor([0, 1]), None)
    with pytest.raises(ValueError, match="ids must be in"):
        ops.make_row_id_map(torch.tensor([[-3, 0]]), 2, True, 1)


def test_sanitizer_findings_raise():
    """Inputs that read or write out of bounds (or overflow) in csrc/ without their checks,
    as an ASan/UBSan build showed: each must be a ValueError."""
    x = torch.arange(8.0).reshape(4, 2)
    with pytest.raises(ValueError, match="chunk 0 repeats"):  # heap overflow of src
        ops.sort_chunks(x, torch.tensor([4, 0]), torch.tensor([0, 0]), None)
    for sizes in ([2**62] * 4, [2**63 - 1, 1]):  # the sum wrapped past the T check
        with pytest.raises(ValueError, match="sum to at most"):
            ops.sort_chunks(x, torch.tensor(sizes), torch.arange(len(sizes)), None)
    with pytest.raises(ValueError, match="sum to at most"):  # the public check wrapped too
        qmoe.moe_sort_chunks_by_index(x, torch.tensor([2**62] * 4), torch.arange(4))
    q = torch.randint(0, 255, (3, 128), dtype=torch.uint8)
    m = torch.zeros(3, 2, dtype=torch.bool)
    m[:, 0] = True
    _, rid = qmoe.moe_permute(torch.randn(3, 4), m)
    for layout, scale in ((1, torch.rand(3, 1)), (1, torch.rand(3, 0)), (2, torch.tensor(1.0))):
        with pytest.raises(ValueError, match="block scales must be"):  # read past the scales
            ops.unpermute_fp8(q, scale, rid, None, layout, 32, torch.float8_e4m3fn,
                              torch.float32)
    rid2 = torch.tensor([[0, -1, 0, -1, 1], [1, 2, 0, 1, 2], [-1, -1, -1, -1, 0]],
                        dtype=torch.int32)
    g = torch.randn(3, 64)
    with pytest.raises(ValueError, match="merging_probs must be"):
        ops.unpermute_backward(g, rid2, torch.rand(1, 2), torch.randn(3, 64), 3)
    with pytest.raises(ValueError, match="fwd_inp must be"):
        ops.unpermute_backward(g, rid2, torch.rand(3, 2), torch.randn(1, 4), 3)
    with pytest.raises(ValueError, match="could pad past"):  # starts overflowed
        ops.make_row_id_map(torch.ones(4, 4, dtype=torch.bool), 16, False, 2**62)
    with pytest.raises(ValueError, match="row_id_map rows are int32"):  # rows truncated
        ops.make_row_id_map(torch.tensor([[5, 1]]), 10**12, True, 1)


def test_outputs_fully_written():
    """The C++ ops write every byte of their outputs: zero rows of a fixed-size permute
    (spare rows), tokens with no route in a merge, rows past the chunks in a chunk sort.
    Meaningful in the poisoned run below, where every fresh allocation holds 0x5A bytes."""
    from qmoe.ops.fp8 import bits_of, scale_layout

    t, h, e = 24, 40, 6
    ids, mask = routing(t, e, 2, "no_route_tokens")
    x = torch.randn(t, h)
    n = int(mask.sum()) + 7  # seven rows no route fills
    rid = _mask_rows(mask, n, 1)
    assert_same_bits(ops.permute(x, rid, None, n)[0], TI.permute_rows(x, rid, n))
    y = torch.randn(n, h)
    w = torch.rand(t, e)
    bits, srows = torch.randint(0, 256, (t, h), dtype=torch.uint8), torch.rand(t, 2)
    got_bits, got_s, got_pp = ops.permute_with_scales(bits, srows, rid, w, n)
    assert_same_bits(got_bits, TI.permute_rows(bits, rid, n))
    assert_same_bits(got_s, TI.permute_rows(srows, rid, n))
    assert torch.equal(got_pp, ops.permute(bits, rid, w, n)[1])
    for weights in (None, w):
        assert_same_bits(ops.unpermute(y, rid, weights),
                         TI.unpermute_rows(y, rid, weights))
    q = qmoe.quantize(torch.randn(n, 256), qmoe.Blockwise())
    got = ops.unpermute_fp8(bits_of(q), q.raw_scale, rid, w, scale_layout(q), 128, q.fp8_dtype,
                            torch.float32)
    assert_same_bits(got, TI.unpermute_fp8_rows(bits_of(q), q.raw_scale, scale_layout(q), 128,
                                               q.fp8_dtype, rid, w, torch.float32))
    sizes, order = torch.tensor([5, 0, 9]), torch.tensor([2, 0, 1])  # 10 rows stay
    got = ops.sort_chunks(x, sizes, order, None)
    assert_same_bits(got[0], x[chunk_source_rows(sizes, order, t)])
    got = ops.sort_chunks_rows(bits, srows, sizes, order, None)
    assert_same_bits(got[0], bits[chunk_source_rows(sizes, order, t)])
    assert_same_bits(got[1], srows[chunk_source_rows(sizes, order, t)])


_POISON = {"MALLOC_PERTURB_": "165", "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}


def test_malloc_poison_active():
    """In the poisoned run: glibc fills every fresh allocation up to 32 MiB with 0x5A."""
    if os.environ.get("MALLOC_PERTURB_") != _POISON["MALLOC_PERTURB_"]:
        pytest.skip("runs inside test_every_cpp_test_with_poisoned_allocations")
    for numel in (1000, 3 << 20):
        assert (torch.empty(numel, dtype=torch.uint8) == 0x5A).all()


def test_every_cpp_test_with_poisoned_allocations():
    """This file again in a child process whose glibc malloc fills each fresh block (and
    blocks up to 32 MiB come from the heap, not from zeroed mmap pages) with 0x5A bytes:
    every output byte a C++ op leaves unwritten shows against the torch path's results."""
    if os.environ.get("MALLOC_PERTURB_"):
        pytest.skip("already the poisoned run")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
         "not test_every_cpp_test_with_poisoned_allocations"],
        env={**os.environ, **_POISON}, cwd=Path(__file__).resolve().parents[1],
        capture_output=True, text=True, timeout=1200,
    )
    tail = r.stdout[-3000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    assert " passed" in tail and "skipped" not in tail.split("passed")[-1], tail

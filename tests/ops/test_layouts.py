"""Strided and transposed operands give the same bits as contiguous ones on every Triton
launcher (CUDA, or the interpreter): probs and merging weights with a column stride, a
non-contiguous row_id_map, 1-d probs and chunk tables with a stride. The kernels step
columns by one and take only row strides, so the launchers must hand them unit-stride
operands (``row_id_map.unit_stride``); each case here read wrong entries before."""

import pytest
import torch

import qmoe
from qmoe.ops import torch_impl as TI
from qmoe.ops.fp8 import bits_of, scale_layout
from qmoe.ops.kernels import permute as KP
from qmoe.ops.kernels import unpermute as KU
from qmoe.tensors.quantize import recipe_scale_mode
from tests.ops.helpers import routing
from tests.tensors.helpers import assert_same_bits


def _col_strided(t: torch.Tensor) -> torch.Tensor:
    """The same values with strides (1, T): the transpose of a contiguous tensor."""
    return t.t().contiguous().t()


def _map(t, e, k, kdevice, n_extra=0):
    _, mask = routing(t, e, k, "sentinels", kdevice)
    n = int(mask.sum()) + n_extra
    rid, fill = torch.ops.qmoe.make_row_id_map(mask, n, False, 1)
    return mask, n, rid, fill


def test_scatter_and_merge(kdevice):
    t, h, e = 37, 24, 6
    mask, n, rid, fill = _map(t, e, 3, kdevice, 5)
    x = torch.randn(t, h, device=kdevice)
    w = torch.rand(t, e, device=kdevice)
    p = torch.rand(t, e, device=kdevice, dtype=torch.float64)
    rid_nc = _col_strided(rid)
    assert not rid_nc.is_contiguous() and _col_strided(w).stride(1) != 1
    for f in (None, fill):
        outs = []
        for ww, pp, rr in ((w, p, rid), (_col_strided(w), _col_strided(p), rid_nc)):
            po = torch.full((n,), float("nan"), device=kdevice, dtype=p.dtype)
            o = KP.permute_rows_triton(x, rr, n, ww, probs=pp, probs_out=po, fill=f)
            outs.append((o, po))
        assert_same_bits(outs[1][0], outs[0][0])
        assert_same_bits(outs[1][1], outs[0][1])
    y = torch.randn(n, h, device=kdevice)
    want = KU.unpermute_rows_triton(y, rid, w)
    assert_same_bits(KU.unpermute_rows_triton(y, rid_nc, _col_strided(w)), want)
    q = qmoe.quantize(y, qmoe.Blockwise(block_size=16))
    args = (bits_of(q), q.raw_scale, scale_layout(q), q.block_size, q.fp8_dtype)
    want = KU.unpermute_fp8_triton(*args, rid, w, torch.float32)
    got = KU.unpermute_fp8_triton(*args, rid_nc, _col_strided(w), torch.float32)
    assert_same_bits(got, want)
    from qmoe.ops.kernels.unpermute import merge_backward_triton

    g = torch.randn(t, h, device=kdevice)
    want = merge_backward_triton(g, y, rid, w)
    got = merge_backward_triton(g, y, rid_nc, _col_strided(w))
    for a, b in zip(got, want):
        assert_same_bits(a, b)


def test_fused_mask_and_quantize_kernels(kdevice):
    from qmoe.ops.kernels.permute_mask import permute_mask_triton
    from qmoe.ops.kernels.quantize_permute import (
        quantize_permute_mask_triton,
        quantize_permute_triton,
    )

    t, h, e = 29, 64, 5
    mask, n, rid, fill = _map(t, e, 2, kdevice)
    x = torch.randn(t, h, device=kdevice)
    p = torch.rand(t, e, device=kdevice)
    want = permute_mask_triton(x, mask, n, 1, p)
    got = permute_mask_triton(x, mask, n, 1, _col_strided(p))
    assert got[2] is None and want[2] is None  # no side rows
    for a, b in zip(got[:2] + got[3:], want[:2] + want[3:]):
        assert_same_bits(a, b)
    r = qmoe.MXFP8()
    mode = (r.block_size, r.fp8_dtype, recipe_scale_mode(r), None)
    want = quantize_permute_triton(x, rid, p, n, *mode, fill)
    got = quantize_permute_triton(x, _col_strided(rid), _col_strided(p), n, *mode, fill)
    for a, b in zip(got, want):
        assert_same_bits(a, b)
    want = quantize_permute_mask_triton(x, mask, n, 1, p, *mode)
    got = quantize_permute_mask_triton(x, mask, n, 1, _col_strided(p), *mode)
    for a, b in zip(got, want):
        assert_same_bits(a, b)


def test_chunk_sort_tables_and_probs(kdevice):
    from qmoe.ops.kernels.sort_chunks import sort_chunks_triton

    x = torch.randn(10, 4, device=kdevice)
    # every other entry of a 2-d table: the stride-1 neighbours are valid sizes too, so a
    # kernel reading them gives a wrong order without tripping its checks
    sizes = torch.tensor([[3, 1], [0, 2], [5, 0], [2, 4]], device=kdevice)[:, 0]
    order = torch.tensor([[2, 1], [0, 3], [3, 0], [1, 2]], device=kdevice)[:, 0]
    probs = torch.rand(10, 2, device=kdevice)[:, 1]
    assert sizes.stride(0) == 2 and probs.stride(0) == 2
    want = sort_chunks_triton(x, sizes.contiguous(), order.contiguous(), probs.contiguous())
    got = sort_chunks_triton(x, sizes, order, probs)
    for a, b in zip(got, want):
        assert_same_bits(a, b)
    assert torch.equal(got[0].cpu(), x[[3, 4, 5, 6, 7, 0, 1, 2, 8, 9]].cpu())


@pytest.mark.parametrize("bad_col", [1_000_000, -1, 6])
def test_cpu_paths_refuse_a_bad_probs_column(bad_col):
    """A map naming a probs column outside [0, P) is a ValueError on the CPU paths (the
    C++ kernels read weights at that column: a segfault before; the torch path wrapped
    negative columns); the Triton kernels' check_routes covers CUDA."""
    x = torch.randn(6, 8)
    m = torch.zeros(6, 6, dtype=torch.bool)
    m[:, 0] = True
    out, rid = qmoe.moe_permute(x, m)
    bad = rid.clone()
    bad[0, 6] = bad_col  # token 0's first probs column (S = 6)
    w = torch.ones(6, 6)
    with pytest.raises(ValueError, match="probs column"):
        qmoe.moe_unpermute(out, bad, w)
    with pytest.raises(ValueError, match="probs column"):
        TI.unpermute_rows(out, bad, w)
    with pytest.raises(ValueError, match="probs column"):
        TI.permute_rows(x, bad, out.shape[0], w)


@pytest.mark.parametrize("where,value", [("row", -5), ("row", 1000), ("count", 100),
                                         ("count", -1)])
def test_cpu_paths_refuse_a_corrupted_map(where, value):
    """A kept route naming a row outside the permuted rows, or a route count outside [0, S],
    is a ValueError on both CPU paths alike (guards against the torch path dropping a
    negative row or ignoring the count where the C++ path raises)."""
    x = torch.randn(6, 8)
    m = torch.zeros(6, 3, dtype=torch.bool)
    m[:, :2] = True
    out, rid = qmoe.moe_permute(x, m)
    bad = rid.clone()
    bad[0, 0 if where == "row" else -1] = value
    w = torch.ones(6, 3)
    calls = [  # the ops (C++ when built, else the torch path), then the torch path itself
        lambda: torch.ops.qmoe.unpermute(out, bad, w),
        lambda: torch.ops.qmoe.unpermute(out, bad, None),
        lambda: torch.ops.qmoe.permute(x, bad, None, out.shape[0]),
        lambda: TI.unpermute_rows(out, bad, w),
        lambda: TI.permute_rows(x, bad, out.shape[0]),
        lambda: qmoe.moe_unpermute(out, bad, w),  # the public function (its own checks first)
    ]
    for call in calls:
        with pytest.raises(ValueError, match="row_id_map (row|counts|names|points)"):
            call()


def test_public_unpermute_takes_a_noncontiguous_map(device):
    """The C++ path refused it (RuntimeError), the Triton path read wrong rows."""
    x = torch.randn(9, 16, device=device)
    _, mask = routing(9, 5, 2, "random", device)
    out, rid = qmoe.moe_permute(x, mask)
    w = torch.rand(9, 5, device=device)
    want = qmoe.moe_unpermute(out, rid, w)
    assert_same_bits(qmoe.moe_unpermute(out, _col_strided(rid), _col_strided(w)), want)


def test_index_ids_past_int32_raise(device):
    """Index maps key experts on int32 with 2**31 - 1 as the "unrouted" sentinel: an id that
    large (int32 included) or larger (int64, wrapped when narrowed) was dropped but counted,
    or taken for another expert, depending on the path. The public ops refuse it on both
    the syncing and the sync-free form (an async assert on CUDA)."""
    x = torch.randn(2, 8, device=device)
    for big, dtype in ((2**31 - 1, torch.int32), (2**31, torch.int64), (2**40, torch.int64)):
        ids = torch.tensor([[0, big], [1, -1]], dtype=dtype, device=device)
        for n in (None, 3):
            if device == "cuda" and n is not None:
                continue  # an async device assert: it would end the CUDA context
            with pytest.raises(ValueError, match="renumber the experts"):
                qmoe.moe_permute(x, ids, n, map_type="index")
    ok = torch.tensor([[0, 2**31 - 2], [1, -1]], device=device)
    assert qmoe.moe_permute(x, ok, 3, map_type="index")[1].shape == (2, 5)

"""Ops that keep qdata and scale consistent: bit-exact against the sliced originals."""

import pytest
import torch

import qmoe
from tests.tensors.helpers import LAYOUTS, assert_same_bits, assert_same_quantized, on_bytes

H = [1, 17, 129, 300]


def _q(name, *shape, dtype=torch.bfloat16):
    return qmoe.quantize(torch.randn(*shape, dtype=dtype), LAYOUTS[name])


def _check_rows(out, q, fn):
    """``out`` equals ``fn`` applied to qdata and (block) scales of ``q``."""
    assert type(out) is type(q) and out._attrs() == q._attrs()
    assert_same_bits(out.qdata, on_bytes(fn, q.qdata))
    want_scale = q.raw_scale if q.block_size is None else on_bytes(fn, q.raw_scale)
    assert_same_bits(out.raw_scale, want_scale)
    assert out.shape == out.qdata.shape


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("h", H)
def test_row_slicing(name, h):
    q = _q(name, 11, h)
    idx = torch.randint(0, 11, (7,))
    mask = torch.rand(11) > 0.5
    _check_rows(q[2:9:3], q, lambda t: t[2:9:3])
    _check_rows(q.narrow(0, 4, 5), q, lambda t: t.narrow(0, 4, 5))
    _check_rows(q.index_select(0, idx), q, lambda t: t.index_select(0, idx))
    _check_rows(q[idx], q, lambda t: t[idx])
    _check_rows(q[mask], q, lambda t: t[mask])
    _check_rows(q[-1], q, lambda t: t[-1])
    _check_rows(q.select(0, 3), q, lambda t: t.select(0, 3))
    for part, ref in zip(q.split([3, 0, 8]), range(3)):
        sl = [slice(0, 3), slice(3, 3), slice(3, 11)][ref]
        _check_rows(part, q, lambda t, sl=sl: t[sl])
    chunks = q.chunk(4)
    assert len(chunks) == 4
    _check_rows(chunks[1], q, lambda t: t.chunk(4)[1])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_leading_dims_3d(name):
    q = _q(name, 4, 6, 160)
    _check_rows(q[:, 1:4], q, lambda t: t[:, 1:4])
    _check_rows(q.view(24, 160), q, lambda t: t.view(24, t.shape[-1]))
    _check_rows(q.reshape(2, 12, 160), q, lambda t: t.reshape(2, 12, t.shape[-1]))
    _check_rows(q.view(-1, 160), q, lambda t: t.view(-1, t.shape[-1]))
    _check_rows(q.flatten(0, 1), q, lambda t: t.flatten(0, 1))
    _check_rows(q[1, 2:5], q, lambda t: t[1, 2:5])
    assert q.numel() == 4 * 6 * 160 and q.dim() == 3 and q.size(1) == 6


@pytest.mark.parametrize("name", ["blockwise-e4m3", "mx-e4m3"])
def test_ops_that_cut_blocks_raise(name):
    q = _q(name, 4, 256)
    bs = q.block_size
    with pytest.raises(ValueError, match="last dim"):
        q.view(4, 2, 128)
    with pytest.raises(ValueError, match="cuts through"):
        q[:, 1:bs]
    with pytest.raises(ValueError, match="cuts through"):
        q[:, ::2]
    with pytest.raises(ValueError, match="last dim"):
        q[:, 3]
    with pytest.raises(ValueError, match="last dim"):
        q.split(bs, dim=-1)
    with pytest.raises(ValueError, match="last dim"):
        torch.cat([q, q], dim=1)
    with pytest.raises(ValueError, match="last dim"):
        q.index_select(1, torch.tensor([0]))
    with pytest.raises(ValueError, match="last dim"):
        q[:, torch.tensor([0, 1])]
    with pytest.raises(ValueError, match="last dim"):  # a mask over both dims covers H
        q[torch.rand(4, 256) > 0.5]
    rows = torch.tensor([True, False, True, True])  # a mask over the rows alone is fine
    assert_same_bits(q[rows].qdata, q.qdata[rows])


@pytest.mark.parametrize("name", ["blockwise-e4m3", "mx-e4m3"])
def test_block_aligned_h_slice(name):
    q = _q(name, 3, 300)
    bs = q.block_size
    out = q[:, bs : 2 * bs]
    assert_same_bits(out.qdata, q.qdata[:, bs : 2 * bs])
    assert_same_bits(out.raw_scale, q.raw_scale[:, 1:2])
    tail = q[:, 2 * bs :]  # ends at H: the partial last block comes along
    assert_same_bits(tail.qdata, q.qdata[:, 2 * bs :])
    assert_same_bits(tail.raw_scale, q.raw_scale[:, 2:])
    assert torch.equal(tail.dequantize(), q.dequantize()[:, 2 * bs :])


def test_per_tensor_any_h_op():
    q = _q("pertensor-e4m3", 4, 100)
    out = q[:, 3:50:7]
    assert_same_bits(out.qdata, q.qdata[:, 3:50:7])
    assert torch.equal(out.scale, q.scale)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cat_and_stack(name):
    a, b = _q(name, 3, 129), _q(name, 5, 129)
    if a.block_size is None:  # per-tensor: equal scales concatenate bit-exactly
        b = qmoe.Float8Tensor(b.qdata, a.scale.clone(), b.orig_dtype)
    out = torch.cat([a, b])
    assert out.shape == (8, 129)
    assert_same_bits(out.qdata, torch.cat([a.qdata, b.qdata]))
    if a.block_size is not None:
        assert_same_bits(out.raw_scale, torch.cat([a.raw_scale, b.raw_scale]))
    s = torch.stack([a, a[:3]], dim=1)
    assert s.shape == (3, 2, 129)
    assert_same_bits(s.qdata, torch.stack([a.qdata, a.qdata], 1))


def test_cat_per_tensor_different_scales_rescales():
    x, y = torch.randn(4, 64), 10 * torch.randn(4, 64)
    a, b = qmoe.quantize(x, qmoe.PerTensor()), qmoe.quantize(y, qmoe.PerTensor())
    out = torch.cat([a, b])
    assert torch.equal(out.scale, torch.maximum(a.scale, b.scale))
    assert_same_bits(out.qdata[4:], b.qdata)  # the larger scale's data is unchanged
    ref = torch.cat([a.dequantize(), b.dequantize()]).float()
    err = (out.dequantize().float() - ref).abs()
    assert torch.all(err <= ref.abs() * 2**-3 + out.scale * 2**-9)  # one fp8 rounding


def test_cat_mixed_recipes_raises():
    x = torch.randn(4, 128)
    with pytest.raises(TypeError, match="one recipe"):
        torch.cat([qmoe.quantize(x, qmoe.Blockwise()), qmoe.quantize(x, qmoe.MXFP8())])
    with pytest.raises(TypeError, match="one recipe"):
        torch.cat([
            qmoe.quantize(x, qmoe.MXFP8()),
            qmoe.quantize(x, qmoe.MXFP8(torch.float8_e5m2)),
        ])
    with pytest.raises(TypeError, match="one recipe"):
        torch.cat([
            qmoe.quantize(x, qmoe.Blockwise()),
            qmoe.quantize(x, qmoe.Blockwise(block_size=64)),
        ])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_detach_clone_to_contiguous(name):
    q = _q(name, 5, 70)
    for out in (q.detach(), q.clone(), q.contiguous(), q.to("cpu"), q.to(torch.bfloat16)):
        assert_same_quantized(out, q)
    c = q.clone()
    assert c.qdata.data_ptr() != q.qdata.data_ptr()
    assert c.raw_scale.data_ptr() != q.raw_scale.data_ptr()  # per-tensor scales too
    f = q.to(torch.float32)
    assert type(f) is torch.Tensor and f.dtype == torch.float32
    assert torch.equal(f, q.dequantize(torch.float32))
    assert torch.equal(q.float(), q.dequantize(torch.float32))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_strided_rows_report_their_layout(name):
    """The wrapper's strides are its qdata's: a row-strided view is not contiguous, and
    .contiguous() gives a fresh contiguous copy (it returned the view itself, qdata still
    strided, when the wrapper always claimed contiguous strides)."""
    q = _q(name, 10, 96)
    v = q[::2]
    assert v.stride() == v.qdata.stride() and not v.is_contiguous()
    c = v.contiguous()
    assert c.is_contiguous() and c.qdata.is_contiguous()
    assert_same_quantized(c, v)
    assert q.is_contiguous() and q.contiguous() is q


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_empty_like_and_copy(name):
    q = _q(name, 6, 129)
    e = torch.empty_like(q)
    assert type(e) is type(q) and e.shape == q.shape and e.raw_scale.shape == q.raw_scale.shape
    e.copy_(q)
    assert_same_quantized(e, q)
    plain = torch.empty(6, 129, dtype=torch.bfloat16)
    plain.copy_(q)
    assert torch.equal(plain, q.dequantize())
    with pytest.raises(TypeError, match="same recipe"):
        e.copy_(torch.randn(6, 129))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_empty_tensors(name):
    q = _q(name, 0, 129)
    assert q[0:0].shape == (0, 129)
    assert torch.cat([q, q]).shape == (0, 129)
    assert q.index_select(0, torch.tensor([], dtype=torch.long)).shape == (0, 129)
    assert q.view(0, 1, 129).shape == (0, 1, 129)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_to_device_roundtrip(name):
    q = _q(name, 5, 200)
    g = q.to("cuda")
    assert g.device.type == "cuda" and g.qdata.is_cuda and g.raw_scale.is_cuda
    assert_same_quantized(g.cpu(), q)


def test_gathered_rows_own_their_per_tensor_scale():
    """Rows made by a gather (index_select, advanced indexing) get their own copy of a
    per-tensor scale, so a copy_ into them leaves their source alone; views (slices) share
    it, and a whole-tensor copy_ (empty_like buffers, load_state_dict) takes data and scale
    bit for bit."""
    x = torch.randn(4, 64)
    src = qmoe.quantize(x, qmoe.PerTensor())
    before = src.dequantize().clone()
    g = src[torch.tensor([0, 2])]
    assert g.raw_scale.data_ptr() != src.raw_scale.data_ptr()
    assert src[1:].raw_scale.data_ptr() == src.raw_scale.data_ptr()
    g.copy_(qmoe.quantize(x[:2] * 100, qmoe.PerTensor()))
    assert torch.equal(src.dequantize(), before)
    b = qmoe.quantize(x * 0.5, qmoe.PerTensor())
    e = torch.empty_like(b)
    e.copy_(b)
    assert_same_bits(e.qdata, b.qdata)
    assert torch.equal(e.scale, b.scale)


@pytest.mark.parametrize("op", ["zero_", "mul_", "index_put_"])
def test_in_place_fallback_refuses(op):
    """An in-place op without a quantized implementation raises: the fallback would modify a
    dequantized temporary and leave the tensor unchanged."""
    q = qmoe.quantize(torch.randn(4, 128), qmoe.Blockwise())
    calls = {"zero_": lambda: q.zero_(), "mul_": lambda: q.mul_(2),
             "index_put_": lambda: q.index_put_((torch.tensor([1]),), torch.zeros(1, 128))}
    with pytest.raises(qmoe.QuantizedDispatchError, match="writes into a Float8BlockwiseTensor"):
        calls[op]()


def test_in_place_fallback_into_plain_tensors_works():
    """Plain destinations of a quantized source run through the fallback for real."""
    q = qmoe.quantize(torch.randn(4, 64), qmoe.PerTensor())
    d = q.dequantize()
    for op in (lambda p: p.__iadd__(q), lambda p: p.index_copy_(0, torch.arange(4), q),
               lambda p: torch.mul(q, 1, out=p)):
        p = torch.zeros(4, 64)
        with pytest.warns(qmoe.QuantizedFallbackWarning):
            op(p)
        assert torch.equal(p, d)


def test_cat_with_a_plain_tensor_first():
    q = qmoe.quantize(torch.randn(2, 64), qmoe.Blockwise(32))
    with pytest.raises(TypeError, match="one recipe"):
        torch.cat([torch.randn(2, 64), q])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_leading_dim_view_ops(name):
    """unsqueeze / squeeze / unbind (and iteration) / expand of leading dims keep the type
    (no dequantizing fallback: strict dispatch), moving bits and scales as on plain
    tensors; an empty slice of H is fine on every layout."""
    q = _q(name, 4, 256)
    with qmoe.strict_dispatch():
        _check_rows(q[None], q, lambda t: t[None])
        _check_rows(q[:, None], q, lambda t: t[:, None])
        _check_rows(q.unsqueeze(-2), q, lambda t: t.unsqueeze(-2))
        _check_rows(q[None].squeeze(0), q, lambda t: t)
        _check_rows(q.view(1, 4, 1, 256).squeeze(), q, lambda t: t)
        rows = q.unbind(0)
        assert len(rows) == 4 and len(list(q)) == 4
        for i, r in enumerate(rows):
            _check_rows(r, q, lambda t, i=i: t[i])
        e = q[None].expand(3, 4, 256)
        _check_rows(e, q, lambda t: t[None].expand(3, 4, t.shape[-1]))
        assert torch.equal(e.dequantize()[2], q.dequantize())
        empty = q[:, 256:]
        assert empty.shape == (4, 0) and empty.dequantize().shape == (4, 0)


@pytest.mark.parametrize("name", ["blockwise-e4m3", "mx-e4m3", "pertensor-e4m3"])
def test_leading_dim_view_ops_refuse_h(name):
    q = _q(name, 4, 256)
    with pytest.raises(ValueError, match="unsqueeze after the last dim"):
        q.unsqueeze(-1)
    with pytest.raises(ValueError, match="may not change the last dim"):
        q.expand(4, 512)
    with pytest.raises(ValueError, match="unbind along the last dim"):
        q.unbind(-1)
    h1 = qmoe.quantize(torch.randn(4, 1), LAYOUTS[name])
    with pytest.raises(ValueError, match="without H"):
        h1.squeeze(-1)
    assert h1[None].squeeze().shape == (4, 1)  # squeeze() keeps H

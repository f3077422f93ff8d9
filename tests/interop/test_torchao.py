"""torchao's FP8 tensors through qmoe's ops (eager and compiled) and the conversions.

Skipped without torchao (the ``torchao`` extra); CI installs it.
"""

import pytest
import torch

ao = pytest.importorskip("torchao")

from torchao.float8 import Float8TrainingTensor  # noqa: E402
from torchao.float8.config import ScalingGranularity  # noqa: E402
from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic  # noqa: E402
from torchao.float8.float8_training_tensor import LinearMMConfig  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import MXTensor  # noqa: E402
from torchao.quantization import Float8Tensor as AOFloat8Tensor  # noqa: E402
from torchao.quantization import PerBlock, PerRow, PerTensor  # noqa: E402

import qmoe  # noqa: E402
from qmoe.interop.torchao import _parts  # noqa: E402
from qmoe.ops import reference as R  # noqa: E402
from tests.ops.helpers import routing  # noqa: E402
from tests.tensors.helpers import assert_same_bits, tiny_mx_blocks  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

LAYOUTS = {
    "ao-pertensor": lambda x: AOFloat8Tensor.from_hp(x, granularity=PerTensor()),
    "ao-perrow": lambda x: AOFloat8Tensor.from_hp(x, granularity=PerRow()),
    "ao-block1x32-e5m2": lambda x: AOFloat8Tensor.from_hp(x, torch.float8_e5m2,
                                                        granularity=PerBlock([1, 32])),
    "mx-e4m3": lambda x: MXTensor.to_mx(x, torch.float8_e4m3fn, 32),
    "mx-e5m2": lambda x: MXTensor.to_mx(x, torch.float8_e5m2, 32),
    "train-tensorwise": lambda x: hp_tensor_to_float8_dynamic(x, torch.float8_e4m3fn,
                                                              LinearMMConfig()),
    "train-rowwise": lambda x: hp_tensor_to_float8_dynamic(
        x, torch.float8_e4m3fn, LinearMMConfig(),
        scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=-1),
    "train-colwise": lambda x: hp_tensor_to_float8_dynamic(
        x, torch.float8_e4m3fn, LinearMMConfig(),
        scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=0),
}


def deq(t):
    """torchao's own dequantization, fp32."""
    if isinstance(t, Float8TrainingTensor):
        return t.to_original_precision().float()
    return t.dequantize().float()


def deq64(t):
    """The exact (fp64) dequantization of a torchao tensor, in its own convention."""
    d, s, rows = _parts(t)
    v = d.double()
    if isinstance(t, MXTensor):
        s = torch.pow(2.0, s.view(torch.uint8).double() - 127)
    s = s.double()
    if s.dim() == 2 and s.shape[0] == v.shape[0] and s.shape[1] > 1:
        s = s.repeat_interleave(v.shape[1] // s.shape[1], dim=1)
    return v / s if isinstance(t, Float8TrainingTensor) else v * s


def check_moved(out, src, mask, n, align=1, chunks=None):
    """out's data bytes (and per-row scales) are the reference movement of src's."""
    assert type(out) is type(src)
    d_out, s_out, rows = _parts(out)
    d_src, s_src, _ = _parts(src)
    ones = torch.ones(mask.shape[0], 1, device=mask.device)
    u8 = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t  # noqa: E731
    if chunks is None:
        want = R.permute(u8(d_src), mask, "mask", n, align_size=align)[0]
    else:
        want = R.sort_chunks(u8(d_src), *chunks)[0]
    assert_same_bits(u8(d_out), want)
    if rows:
        if chunks is None:
            kept = R.permute(ones, mask, "mask", n, align_size=align)[0]
            kept = kept[:, 0] == 1
            ws = R.permute(u8(s_src), mask, "mask", n, align_size=align)[0]
            assert_same_bits(u8(s_out).cpu()[kept], ws[kept])
        else:
            assert_same_bits(u8(s_out), R.sort_chunks(u8(s_src), *chunks)[0])
    else:
        assert_same_bits(s_out, s_src)
    d = deq(out).cpu()
    assert torch.isfinite(d).all()
    if chunks is None:  # rows no route fills dequantize to exact zeros
        filled = R.permute(ones, mask, "mask", n, align_size=align)[0]
        assert (d[filled[:, 0] == 0] == 0).all()


_NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=_NEEDS_CUDA)]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_op_moves_torchao_rows_bit_exactly(name, dev):
    """On CUDA the rows move through qmoe's Triton kernels (torchao quantizes there too)."""
    t, h, e, k = 37, 96, 6, 2
    x = torch.randn(t, h, dtype=torch.bfloat16, device=dev) * 3
    src = LAYOUTS[name](x)
    ids, mask = routing(t, e, k, "sentinels", dev)
    probs = torch.rand(t, e, device=dev)
    routed = int(mask.sum())
    for n in (routed, routed - 9, routed + 4):
        out, pp, rid = qmoe.moe_permute_with_probs(src, probs, mask, n)
        assert _parts(out)[0].device == x.device
        check_moved(out, src, mask, n)
        assert_same_bits(pp, R.permute(x, mask, "mask", n, probs)[1])
        oi, _ = qmoe.moe_permute(src, ids, n, map_type="index")
        assert_same_bits(_parts(oi)[0].view(torch.uint8), _parts(out)[0].view(torch.uint8))
        # the merge dequantizes (torchao's convention) and sums in fp32
        w = torch.rand(t, e, device=dev)
        y = qmoe.moe_unpermute(out, rid, w)
        assert y.dtype == src.dtype and y.shape == (t, h)
        ref = R.unpermute(deq64(out), mask, "mask", w, n)
        mag = R.unpermute(deq64(out).abs(), mask, "mask", w, n)
        # fp32 dequantize and accumulation, then one bf16 rounding (half an ulp <= 2**-8)
        assert ((y.double().cpu() - ref).abs() <= 2**-8 * ref.abs() + 2**-20 * mag).all()
    out, pp, rid, _, target = qmoe.moe_permute_and_pad_with_probs(src, probs, mask, None, 16)
    check_moved(out, src, mask, None, align=16)
    sizes, order = [5, 0, 20, 12], [2, 0, 3, 1]
    sc, _ = qmoe.moe_sort_chunks_by_index_with_probs(
        src, torch.rand(t, device=dev), torch.tensor(sizes, device=dev),
        torch.tensor(order, device=dev))
    check_moved(sc, src, mask, None, chunks=(sizes, order))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fused_permute_ops_take_torchao_rows(name):
    """``qmoe::permute_mask`` and ``qmoe::permute_index`` (what the public mask permutes
    run on CUDA; their CPU path here) take torchao tensors: data bytes and scale rows equal
    the map-then-permute path's, bit for bit, with dropped and padded rows."""
    t, h, e, k = 37, 96, 6, 2
    src = LAYOUTS[name](torch.randn(t, h, dtype=torch.bfloat16) * 3)
    ids, mask = routing(t, e, k, "sentinels")
    probs = torch.rand(t, e)
    routed = int(mask.sum())
    for n, align in ((routed - 5, 1), (routed + 40, 8)):
        got, pp, so, rid = torch.ops.qmoe.permute_mask(src, mask, probs, None, n, align)
        want, pp_w, rid_w, _, _ = qmoe.moe_permute_and_pad_with_probs(
            src, probs, mask, None, align, num_out_tokens=n)
        assert type(got) is type(src) and so is None
        for g, w in zip(_parts(got)[:2], _parts(want)[:2]):  # data, scale (0-d or rows)
            assert_same_bits(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8))
        assert torch.equal(pp, pp_w) and torch.equal(rid, rid_w)
    pk = torch.rand(t, k)
    got, pp, _, rid = torch.ops.qmoe.permute_index(src, ids, pk, None, routed - 3, e)
    want, pp_w, rid_w = qmoe.moe_permute_with_probs(src, pk, ids, routed - 3, map_type="index")
    for g, w in zip(_parts(got)[:2], _parts(want)[:2]):
        assert_same_bits(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8))
    assert torch.equal(pp, pp_w) and torch.equal(rid, rid_w)
    with pytest.raises(TypeError, match="side rows come from"):
        torch.ops.qmoe.permute_mask(src, mask, None, torch.zeros(t, 2), routed, 1)


@pytest.mark.parametrize("gran", [PerTensor(), PerRow()], ids=["pertensor", "perrow"])
def test_one_row_float8_tensor_stays_consistent(gran):
    """A one-token input's [1, H] block reads as per-tensor and per-row alike; its (1, 1)
    scale is carried, so the N-row output must say per-tensor ([N, H] block). It kept
    [1, H] (per-row) with one scale for N rows: torchao read it as row-wise."""
    from torchao.float8.inference import _is_rowwise_scaled, _is_tensorwise_scaled

    a = AOFloat8Tensor.from_hp(torch.randn(1, 64, dtype=torch.bfloat16), granularity=gran)
    out, _ = qmoe.moe_permute(a, torch.ones(1, 3, dtype=torch.bool))
    assert list(out.block_size) == [3, 64] and tuple(out.scale.shape) == (1, 1)
    assert _is_tensorwise_scaled(out) and not _is_rowwise_scaled(out)
    assert torch.equal(out.dequantize(), a.dequantize().expand(3, -1))


def test_conventions_and_zero_copy_conversions():
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    for name in ("ao-pertensor", "ao-perrow", "ao-block1x32-e5m2", "mx-e4m3"):
        t = LAYOUTS[name](x)
        q = qmoe.from_torchao(t)
        assert q.qdata.data_ptr() == _parts(t)[0].data_ptr()  # the same fp8 bytes
        assert_same_bits(q.dequantize(), t.dequantize())  # qdata * scale, both sides
        back = qmoe.to_torchao(q, type(t))
        assert type(back) is type(t) and back.qdata.data_ptr() == q.qdata.data_ptr()
        assert_same_bits(back.dequantize(), t.dequantize())
    for name in ("train-tensorwise", "train-rowwise"):
        t = LAYOUTS[name](x)
        q = qmoe.from_torchao(t)  # data / scale becomes data * (1 / scale)
        assert q.qdata.data_ptr() == t._data.data_ptr()
        torch.testing.assert_close(q.dequantize(torch.float32).double(), deq64(t),
                                   rtol=2**-22, atol=0)
        back = qmoe.to_torchao(q, Float8TrainingTensor)
        assert back._data.data_ptr() == t._data.data_ptr()
        torch.testing.assert_close(deq64(back), deq64(t), rtol=2**-22, atol=0)
    # qmoe's own recipes out to torchao and back
    for recipe, cls in ((qmoe.PerTensor(), AOFloat8Tensor), (qmoe.Blockwise(), AOFloat8Tensor),
                        (qmoe.MXFP8(), MXTensor), (qmoe.PerTensor(), Float8TrainingTensor)):
        q = qmoe.quantize(x, recipe)
        a = qmoe.to_torchao(q, cls)
        torch.testing.assert_close(deq64(a), q.dequantize(torch.float64), rtol=2**-22, atol=0)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_mx_tiny_blocks_through_torchao(fp8):
    """MX blocks below the OCP exponent -126 (qmoe's byte 1) and all-zero blocks (byte 0):
    the zero-copy MXTensor of qmoe's bytes dequantizes exactly in torchao, and back."""
    x, _ = tiny_mx_blocks(fp8)
    q = qmoe.quantize(x, qmoe.MXFP8(fp8))
    a = qmoe.to_torchao(q, MXTensor)
    assert a.qdata.data_ptr() == q.qdata.data_ptr()
    assert torch.equal(a.dequantize(torch.float32), x)
    back = qmoe.from_torchao(a)
    assert_same_bits(back.qdata, q.qdata)
    assert_same_bits(back.scale_bits, q.scale_bits)


@pytest.mark.parametrize("make,what", [
    (lambda x: AOFloat8Tensor.from_hp(x, granularity=PerBlock([128, 128])), "scale"),
    (lambda x: MXTensor.to_mx(x, torch.float8_e4m3fn, 32, is_swizzled_scales=True), "swizzled"),
])
def test_layouts_that_do_not_map_are_refused(make, what):
    x = torch.randn(128, 256, dtype=torch.bfloat16)
    t = make(x)
    mask = routing(128, 4, 2)[1]
    with pytest.raises(ValueError, match=what):
        qmoe.moe_permute(t, mask, 256)
    with pytest.raises(ValueError, match=what):
        qmoe.from_torchao(t)


@pytest.mark.parametrize("name", ["ao-perrow", "mx-e4m3", "train-tensorwise"])
def test_quantize_of_torchao_rows_is_refused(name):
    """``quantize=`` takes high-precision tokens: a torchao FP8 tensor is already quantized."""
    x = torch.randn(8, 96, dtype=torch.bfloat16)
    mask = routing(8, 4, 2)[1]
    with pytest.raises(TypeError, match="inp is already quantized"):
        qmoe.moe_permute(LAYOUTS[name](x), mask, 16, quantize=qmoe.MXFP8())


def test_conversion_errors():
    x = torch.randn(8, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="per-column"):
        qmoe.from_torchao(LAYOUTS["train-colwise"](x))
    with pytest.raises(ValueError, match="MXTensor needs an MXFP8Tensor"):
        qmoe.to_torchao(qmoe.quantize(x, qmoe.PerTensor()), MXTensor)
    with pytest.raises(ValueError, match="does not tile"):  # blocks of 128 over H 200
        qmoe.to_torchao(qmoe.quantize(torch.randn(4, 200), qmoe.Blockwise()), AOFloat8Tensor)
    one = qmoe.quantize(x, qmoe.Blockwise())  # one partial block a row: per-row scales
    assert torch.equal(qmoe.to_torchao(one, AOFloat8Tensor).dequantize(), one.dequantize())
    with pytest.raises(ValueError, match="not a multiple of 32"):  # torchao could not use it
        qmoe.to_torchao(qmoe.quantize(torch.randn(4, 200), qmoe.MXFP8()), MXTensor)
    with pytest.raises(ValueError, match="contiguous"):
        qmoe.to_torchao(qmoe.quantize(torch.randn(8, 256), qmoe.MXFP8())[::2], MXTensor)
    with pytest.raises(TypeError, match="expected one of torchao"):
        qmoe.from_torchao(x)


@pytest.mark.compile
@pytest.mark.parametrize("name,dev", [("mx-e4m3", "cpu"), ("train-rowwise", "cpu"),
                                      pytest.param("mx-e4m3", "cuda", marks=_NEEDS_CUDA)])
def test_torchao_tensors_under_compile(name, dev):
    """fullgraph=True, inductor: same class out, bit-identical to eager."""
    t, h, e, k = 48, 64, 8, 2
    src = LAYOUTS[name](torch.randn(t, h, dtype=torch.bfloat16, device=dev))
    _, mask = routing(t, e, k, "random", dev)
    probs = torch.rand(t, e, device=dev)

    def f(src, probs):
        out, pp, rid, _, _ = qmoe.moe_permute_and_pad_with_probs(
            src, probs, mask, None, 32, num_out_tokens=t * k + e * 32)
        return out, pp, qmoe.moe_unpermute(out, rid, probs)

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True)(src, probs)
    want = f(src, probs)
    assert type(got[0]) is type(want[0])
    for a, b in zip(_parts(got[0])[:2], _parts(want[0])[:2]):
        assert_same_bits(a, b)
    assert_same_bits(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=0)


def _moe_mxfp8(x, probs, mask, w, e):
    """torchtitan-style MXFP8 expert block: torchao quantizes the tokens, qmoe permutes
    them (groups padded to 32 rows), torchao's MXFP8 grouped mm, qmoe merges."""
    from torchao.prototype.moe_training import _to_mxfp8_then_scaled_grouped_mm
    from torchao.quantization.quantize_.common import KernelPreference

    q = MXTensor.to_mx(x, torch.float8_e4m3fn, 32)
    bound = x.shape[0] * 2 + e * 32  # sync-free form: a fixed upper bound on the rows
    out, pp, rid, _, target = qmoe.moe_permute_and_pad_with_probs(
        q, probs, mask, None, 32, num_out_tokens=bound)
    offs = torch.cumsum(target, 0).to(torch.int32)
    offs[-1] = bound  # spare rows join the last group (zero rows: no effect)
    y = _to_mxfp8_then_scaled_grouped_mm(out, w.transpose(-2, -1), offs=offs,
                                         kernel_preference=KernelPreference.EMULATED,
                                         wgrad_with_hp=True)
    return qmoe.moe_unpermute(y, rid, probs)


def _reference(x, probs, mask, w):
    """bf16 inputs, fp32 math: per route probs[t, e] * x[t] @ w[e].T, summed."""
    ref = torch.zeros(x.shape[0], w.shape[1], device=x.device)
    for ee in range(w.shape[0]):
        rows = mask[:, ee]
        ref = ref.index_add(0, rows.nonzero()[:, 0],
                            (x[rows].float() @ w[ee].float().T) * probs[rows, ee][:, None])
    return ref


def test_torchtitan_style_mxfp8_grouped_mm_pipeline():
    from tests.tensors.helpers import sqnr_db

    t, h, n, e = 64, 64, 96, 4
    x = torch.randn(t, h, dtype=torch.bfloat16)
    ids, mask = routing(t, e, 2)
    probs = torch.rand(t, e)
    w = (torch.randn(e, n, h) / h**0.5).to(torch.bfloat16)
    z = _moe_mxfp8(x, probs, mask, w, e)
    assert z.dtype == torch.bfloat16 and z.shape == (t, n)
    assert sqnr_db(_reference(x, probs, mask, w), z.float()) > 25  # MXFP8 e4m3 forward
    # fullgraph=True through AOTAutograd. Not inductor: on CPU it cannot generate code for
    # the e8m0 scales torchao's to_mx computes inside the block (qmoe's own part compiles
    # with inductor: test_torchao_tensors_under_compile).
    torch._dynamo.reset()
    step = torch.compile(lambda x, p, w: _moe_mxfp8(x, p, mask, w, e), fullgraph=True,
                         backend="aot_eager")
    assert_same_bits(step(x, probs, w), z)


_AO_BWD_BUG = pytest.mark.xfail(
    raises=(TypeError, ValueError), strict=True,
    reason="torchao 0.18, CPU tensors: the MXTensor-input backward calls "
    "triton_mxfp8_dequant_dim0(scale_block_size=...), which its CPU stub does not take "
    "(TypeError); where CUDA exists it launches the Triton kernel on the CPU tensors "
    "(ValueError). Drop this mark when torchao fixes it")


@pytest.mark.parametrize("dev", [pytest.param("cpu", marks=_AO_BWD_BUG), *DEVICES[1:]])
def test_mxfp8_grouped_mm_backward_with_mxtensor_input(dev):
    """The weight gradient through qmoe's permute -> torchao's MXFP8 grouped mm -> qmoe's
    merge, against the fp32 reference's."""
    from tests.tensors.helpers import sqnr_db

    t, h, n, e = 64, 64, 96, 4
    ids, mask = routing(t, e, 2, "random", dev)
    x = torch.randn(t, h, dtype=torch.bfloat16, device=dev)
    probs = torch.rand(t, e, device=dev)
    w = (torch.randn(e, n, h, device=dev) / h**0.5).to(torch.bfloat16).requires_grad_()
    g = torch.randn(t, n, device=dev)
    _moe_mxfp8(x, probs, mask, w, e).backward(g.to(torch.bfloat16))
    w32 = w.detach().float().requires_grad_()
    _reference(x, probs, mask, w32).backward(g)
    assert sqnr_db(w32.grad, w.grad.float()) > 20  # wgrad_with_hp: bf16 grads, MXFP8 fwd


def test_example_runs():
    import runpy
    from pathlib import Path

    runpy.run_path(str(Path(__file__).parents[2] / "examples" / "torchao_interop.py"))


_FIRST_CALL_CHILD = """
import sys, torch, qmoe
from torchao.prototype.mx_formats.mx_tensor import MXTensor
assert "qmoe.interop.torchao" not in sys.modules
x = MXTensor.to_mx(torch.randn(4, 64), torch.float8_e4m3fn, 32)
mask = torch.zeros(4, 2, dtype=torch.bool); mask[:, 1] = True
out, _ = qmoe.moe_permute(x, mask, 4)
assert "qmoe.interop.torchao" in sys.modules and type(out) is MXTensor
print("ok")
"""


def test_first_eager_call_loads_the_rules():
    """``import qmoe`` does not import torchao; the first eager call of a public op with a
    torchao tensor loads qmoe's rules for it (``qmoe.interop`` registers the loader)."""
    import subprocess
    import sys
    from pathlib import Path

    r = subprocess.run([sys.executable, "-c", _FIRST_CALL_CHILD], capture_output=True,
                       text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


@pytest.mark.parametrize("h", [300, 256])
def test_rowwise_rows_convert_as_per_row(h):
    """``qmoe.RowWise`` rows (one block of ``next_pow2(H)`` over each row) are torchao's
    per-row layout: ``Float8Tensor`` with block ``[1, H]`` and ``Float8TrainingTensor``
    (row-wise, ``1 / scale``); back from them, a ``Float8BlockwiseTensor`` with one block
    of H, dequantizing to the same values."""
    x = torch.randn(8, h, dtype=torch.bfloat16)
    q = qmoe.quantize(x, qmoe.RowWise())
    for cls in (AOFloat8Tensor, Float8TrainingTensor):
        t = qmoe.to_torchao(q, cls)
        if cls is AOFloat8Tensor:
            assert list(t.block_size) == [1, h]
            assert torch.equal(t.dequantize(), q.dequantize())
        back = qmoe.from_torchao(t)
        assert back.block_size == h and torch.equal(back.dequantize(), q.dequantize())
        assert_same_bits(back.qdata, q.qdata)

"""quantize / dequantize: layouts, accuracy floors, scale rules, autograd, bad input."""

import contextlib
import math

import pytest
import torch

import qmoe
from qmoe.tensors.quantize import _reference_blocks
from qmoe.tensors.recipes import fp8_max
from tests.tensors.helpers import (
    LAYOUTS,
    RECIPES,
    assert_same_bits,
    assert_same_quantized,
    rceil_inputs,
    rceil_reference,
    sqnr_db,
    tiny_mx_blocks,
)

HS = [1, 17, 127, 129, 7168]


def _expected_dequant(q) -> torch.Tensor:
    """qdata.float() * scale, written out block by block (independent of the library)."""
    qd = q.qdata.float()
    if q.block_size is None:
        return qd * q.scale.float()
    out = torch.empty_like(qd)
    s = q.scale.float()
    for b in range(s.shape[-1]):
        sl = slice(b * q.block_size, (b + 1) * q.block_size)
        out[..., sl] = qd[..., sl] * s[..., b : b + 1]
    return out


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("h", HS)
def test_layout_and_dequantize(name, h):
    recipe = RECIPES[name]
    x = torch.randn(3, 5, h, dtype=torch.bfloat16)
    if isinstance(recipe, qmoe.RowWise) and h > 16384:
        with pytest.raises(ValueError, match="wider than the 16384 a row-wise scale covers"):
            qmoe.quantize(x, recipe)
        return
    q = qmoe.quantize(x, recipe)
    assert q.shape == x.shape and q.dtype == x.dtype and q.orig_dtype == torch.bfloat16
    assert q.qdata.dtype == recipe.fp8_dtype and q.qdata.shape == x.shape
    if isinstance(recipe, qmoe.PerTensor):
        assert type(q) is qmoe.Float8Tensor
        assert q.scale.shape == () and q.scale.dtype == torch.float32
    elif isinstance(recipe, qmoe.Blockwise):
        assert type(q) is qmoe.Float8BlockwiseTensor and q.block_size == 128
        assert q.scale.shape == (3, 5, math.ceil(h / 128)) and q.scale.dtype == torch.float32
    elif isinstance(recipe, qmoe.RowWise):  # one block over each row
        assert type(q) is qmoe.Float8BlockwiseTensor and q.block_size >= h
        assert q.scale.shape == (3, 5, 1) and q.scale.dtype == torch.float32
        amax = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12)
        s = amax / torch.finfo(recipe.fp8_dtype).max
        if recipe.power_of_two_scale:
            s = torch.exp2(torch.ceil(torch.log2(s)))
        assert torch.equal(q.scale, s)
    else:
        assert type(q) is qmoe.MXFP8Tensor
        assert q.scale.shape == (3, 5, math.ceil(h / 32)) and q.scale.dtype == torch.float8_e8m0fnu
    d = q.dequantize()
    assert d.dtype == torch.bfloat16 and type(d) is torch.Tensor
    assert torch.equal(d, _expected_dequant(q).to(torch.bfloat16))
    assert torch.equal(q.dequantize(torch.float32), _expected_dequant(q))


def test_rowwise_refuses_rows_past_its_block_bound():
    with pytest.raises(ValueError, match="wider than the 16384 a row-wise scale covers"):
        qmoe.quantize(torch.randn(2, 16385), qmoe.RowWise())
    with pytest.raises(ValueError, match="wider than the 16384"):
        qmoe.moe_permute(torch.randn(2, 16385), torch.ones(2, 2, dtype=torch.bool), 4,
                         quantize=qmoe.RowWise())


@pytest.mark.parametrize(
    "name,floor_db",
    [
        ("pertensor-e4m3", 25), ("blockwise-e4m3", 28), ("mx-e4m3", 28),
        ("pertensor-e5m2", 19), ("blockwise-e5m2", 22), ("mx-e5m2", 22),
        ("pertensor-pow2", 25), ("blockwise-pow2", 27), ("mx-rceil-e4m3", 28),
        ("rowwise-e4m3", 27), ("rowwise-e5m2-pow2", 20),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sqnr_floor_gaussian(name, floor_db, dtype):
    x = torch.randn(256, 1024).to(dtype)
    q = qmoe.quantize(x, RECIPES[name])
    assert sqnr_db(x, q.dequantize(torch.float32)) >= floor_db


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_block_recipes_beat_per_tensor_on_outlier_rows(fp8):
    x = torch.randn(64, 512)
    # Outlier rows (massive activations) large enough to push the other rows below the
    # format's range under a single scale.
    x[::8] *= 2.0**20 if fp8 == torch.float8_e4m3fn else 2.0**32
    normal = torch.ones(64, dtype=torch.bool)
    normal[::8] = False
    res = {}
    for name, recipe in [
        ("pt", qmoe.PerTensor(fp8)), ("bw", qmoe.Blockwise(fp8_dtype=fp8)), ("mx", qmoe.MXFP8(fp8))
    ]:
        d = qmoe.quantize(x, recipe).dequantize()
        res[name] = sqnr_db(x[normal], d[normal])
    assert res["bw"] > res["pt"] + 10 and res["mx"] > res["pt"] + 10, res
    assert min(res["bw"], res["mx"]) > 20, res


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_mx_scale_is_ocp_floor(fp8):
    x = torch.randn(16, 96) * torch.logspace(-30, 30, 16)[:, None]
    x[3] = 0.0
    q = qmoe.quantize(x, qmoe.MXFP8(fp8))
    amax = x.reshape(16, 3, 32).abs().amax(-1)
    mant, exp = torch.frexp(amax)  # amax = mant * 2**exp, mant in [0.5, 1)
    emax = 8 if fp8 == torch.float8_e4m3fn else 15
    want = (exp - 1 - emax).clamp(-126, 127) + 127  # a nonzero block's byte is >= 1
    want[3] = 0  # all-zero block: the smallest scale
    assert torch.equal(q.scale.view(torch.uint8).long(), want.long())
    # Elements never exceed the format's range and no finite input becomes NaN.
    assert not q.qdata.float().isnan().any()


@pytest.mark.parametrize("path", ["op", "torch"])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mx_tiny_blocks_dequantize_exactly(path, fp8, dtype):
    """Nonzero MX blocks whose OCP exponent falls below -126 (amax < 2**-118 for e4m3,
    2**-111 for e5m2) are divided by 2**-126 and store that scale, byte 1: they come back
    exactly (byte 0, 2**-127, gave them back at half their value). All-zero blocks keep
    byte 0. ``op``: ``qmoe.quantize`` on this machine's CPU backend (the C++ kernels when
    built); ``torch``: the vectorized torch path."""
    x, want = tiny_mx_blocks(fp8, dtype)
    if path == "op":
        q = qmoe.quantize(x, qmoe.MXFP8(fp8))
        qdata, bits = q.qdata, q.scale_bits
    else:
        qdata, bits = _reference_blocks(x, 32, fp8, "mx_floor")
    assert torch.equal(bits, want)
    assert torch.equal(qmoe.MXFP8Tensor(qdata, bits, dtype).dequantize(), x)


@pytest.mark.parametrize("path", ["op", "torch"])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mx_rceil_matches_fp64_reference(path, fp8, dtype):
    """``MXFP8(scale_rounding="rceil")`` (TransformerEngine's rule) against a reference
    written from its definition in Python / numpy scalars, on amaxes at and around every
    power-of-two edge, subnormal quotients, zeros, inf and NaN; ``op`` / ``torch`` as in
    ``test_mx_tiny_blocks_dequantize_exactly``."""
    x = rceil_inputs(fp8, dtype)
    if dtype == torch.float16:  # fp16's range; the edges near its top and bottom stay
        x = x.float().clamp(-6e4, 6e4).to(dtype)
        x[-2, 5], x[-1, 40] = float("inf"), float("nan")
    if path == "op":
        q = qmoe.quantize(x, qmoe.MXFP8(fp8, scale_rounding="rceil"))
        qdata, bits = q.qdata, q.scale_bits
    else:
        qdata, bits = _reference_blocks(x, 32, fp8, "mx_rceil")
    want_q, want_s = rceil_reference(x, fp8)
    assert_same_bits(bits, want_s)
    assert_same_bits(qdata.view(torch.uint8), want_q)
    # the scale rounded up: no block's amax exceeds fp8_max * scale, so nothing saturates
    # (byte 0 blocks divide by 1 and round to +-0; 254 and 255 are inf and NaN)
    amax = x.double().reshape(x.shape[0], -1, 32).abs().amax(-1)
    b = bits.long()
    mid = (b > 0) & (b < 254)
    assert mid.sum() > x.shape[0]
    assert (amax[mid] <= torch.finfo(fp8).max * torch.exp2(b[mid] - 127.0)).all()


def test_mx_rceil_recipe():
    """The recipe takes "floor" and "rceil"; its tensors are plain MXFP8Tensors (the bytes
    describe themselves), so save/load and mixing with floor tensors need nothing more."""
    import io

    with pytest.raises(ValueError, match="'floor' .* or 'rceil'"):
        qmoe.MXFP8(scale_rounding="RCEIL")
    x = torch.randn(6, 96) * 3
    r = qmoe.MXFP8(torch.float8_e5m2, "rceil")
    assert r != qmoe.MXFP8(torch.float8_e5m2) and hash(r) != hash(qmoe.MXFP8(torch.float8_e5m2))
    q = qmoe.quantize(x, r)
    assert type(q) is qmoe.MXFP8Tensor
    buf = io.BytesIO()
    torch.save(q, buf)
    buf.seek(0)
    assert_same_quantized(torch.load(buf, weights_only=True), q)
    both = torch.cat([q, qmoe.quantize(x, qmoe.MXFP8(torch.float8_e5m2))])
    assert_same_bits(both.scale_bits[:6], q.scale_bits)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_amax_scales_follow_the_rule(fp8):
    """The amax-mode scales, recomputed here from their definition (``max(amax, 1e-12) /
    fp8_max`` with fp8_max from ``torch.finfo``, not qmoe's): a scale off by a constant
    factor (half the fp8 range used) passes every SQNR floor, not this."""
    x = torch.randn(5, 384) * torch.logspace(-3, 3, 5)[:, None]
    x[1, 128:256] = 0  # an all-zero block: the 1e-12 floor
    big = torch.tensor(torch.finfo(fp8).max, dtype=torch.float32)
    q = qmoe.quantize(x, qmoe.Blockwise(fp8_dtype=fp8))
    want = x.reshape(5, 3, 128).abs().amax(-1).clamp(min=1e-12) / big
    assert_same_bits(q.raw_scale, want)
    p = qmoe.quantize(x, qmoe.PerTensor(fp8_dtype=fp8))
    assert_same_bits(p.raw_scale, x.abs().amax().clamp(min=1e-12) / big)


@pytest.mark.parametrize("name", ["pertensor-pow2", "blockwise-pow2"])
def test_power_of_two_scales(name):
    recipe = RECIPES[name]
    x = torch.randn(8, 384) * 3.7
    q = qmoe.quantize(x, recipe)
    s = q.scale
    mant, _ = torch.frexp(s)
    assert torch.all(mant == 0.5)
    if s.dim():
        amax = x.reshape(8, 3, 128).abs().amax(-1)
    else:
        amax = x.abs().amax()
    lo = amax / fp8_max(recipe.fp8_dtype)
    assert torch.all(s >= lo) and torch.all(s < 2 * lo)


def test_per_tensor_given_scale():
    x = torch.randn(4, 64)
    s = torch.tensor(0.25)
    q = qmoe.quantize(x, qmoe.PerTensor(), scale=s)
    assert q.scale.item() == 0.25
    assert_same_bits(q.qdata, (x / 0.25).clamp(-448, 448).to(torch.float8_e4m3fn))
    # the scale is copied: updating the caller's tensor in place (delayed scaling) leaves
    # tensors already quantized with it unchanged
    before = q.dequantize().clone()
    s.mul_(2)
    assert_same_bits(q.dequantize(), before)


def test_saturation_and_zeros():
    x = torch.zeros(4, 256)
    for recipe in LAYOUTS.values():
        q = qmoe.quantize(x, recipe)
        assert torch.equal(q.dequantize(), x)
        assert torch.isfinite(q.scale_fp32()).all()
    big = torch.full((2, 64), 1e30)
    s = torch.tensor(1.0)
    q = qmoe.quantize(big, qmoe.PerTensor(), scale=s)
    assert torch.all(q.qdata.float() == 448.0)  # saturates, no inf/NaN


@pytest.mark.parametrize("shape", [(0, 128), (0, 7), (5, 0), (0,)])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_empty(shape, name):
    x = torch.randn(shape)
    q = qmoe.quantize(x, LAYOUTS[name])
    assert q.shape == x.shape and q.numel() == 0
    assert q.dequantize().shape == x.shape


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_straight_through_gradient(name):
    x = torch.randn(6, 200, dtype=torch.bfloat16, requires_grad=True)
    q = qmoe.quantize(x, LAYOUTS[name])
    assert q.requires_grad
    g = torch.randn(6, 200, dtype=torch.bfloat16)
    q.dequantize().backward(g)
    assert x.grad.dtype == torch.bfloat16 and torch.equal(x.grad, g)


def test_bad_input():
    with pytest.raises(TypeError, match="x must be"):
        qmoe.quantize([1.0], qmoe.PerTensor())
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        qmoe.quantize(torch.ones(4, 4, dtype=torch.int32), qmoe.PerTensor())
    with pytest.raises(ValueError, match="scalar"):
        qmoe.quantize(torch.tensor(1.0), qmoe.PerTensor())
    with pytest.raises(TypeError, match="recipe must be"):
        qmoe.quantize(torch.ones(4, 4), "mx")
    with pytest.raises(ValueError, match="only accepted with the PerTensor"):
        qmoe.quantize(torch.ones(4, 4), qmoe.Blockwise(), scale=torch.tensor(1.0))
    with pytest.raises(TypeError, match="already quantized"):
        qmoe.quantize(qmoe.quantize(torch.ones(4, 4), qmoe.PerTensor()), qmoe.PerTensor())
    with pytest.raises(TypeError, match="fp8_dtype"):
        qmoe.PerTensor(torch.bfloat16)
    with pytest.raises(ValueError, match="block_size"):
        qmoe.Blockwise(block_size=100)
    with pytest.raises(ValueError, match="scale_rounding"):
        qmoe.MXFP8(scale_rounding="ceil")
    for recipe in (qmoe.PerTensor, qmoe.Blockwise):
        with pytest.raises(TypeError, match="power_of_two_scale must be True or False"):
            recipe(power_of_two_scale="no")
    x = torch.ones(4, 4)
    for bad in (0.0, -1.0, float("inf"), float("nan")):  # would quantize to zeros or NaN
        with pytest.raises(ValueError, match="scale must be positive and finite"):
            qmoe.quantize(x, qmoe.PerTensor(), scale=torch.tensor(bad))
        with pytest.raises(ValueError, match="quantize_scale must be positive and finite"):
            qmoe.moe_permute(x, torch.ones(4, 2, dtype=torch.bool), 8,
                             quantize=qmoe.PerTensor(), quantize_scale=torch.tensor(bad))
    with pytest.raises(TypeError, match="scale must be a float tensor"):
        qmoe.quantize(x, qmoe.PerTensor(), scale=torch.tensor(2))


@pytest.mark.parametrize("bad", [1e-300, 1e300, 2.0**-150])
def test_float64_scale_out_of_fp32_range(bad):
    """A float64 scale is checked as the fp32 the kernels use: 1e-300 and 2**-150 become 0
    there, 1e300 inf (each finite or positive before the cast); both entry points refuse
    them."""
    x, mask = torch.ones(4, 4), torch.ones(4, 2, dtype=torch.bool)
    s = torch.tensor(bad, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"scale must be positive and finite as float32, got "
                       r".* \(given .* as torch.float64\)"):
        qmoe.quantize(x, qmoe.PerTensor(), scale=s)
    with pytest.raises(ValueError, match="quantize_scale must be positive and finite"):
        qmoe.moe_permute(x, mask, 8, quantize=qmoe.PerTensor(), quantize_scale=s)
    good = torch.tensor(0.25, dtype=torch.float64)  # in range: the fp32 value is used
    assert_same_bits(qmoe.quantize(x, qmoe.PerTensor(), scale=good).qdata,
                     qmoe.quantize(x, qmoe.PerTensor(), scale=good.float()).qdata)


_DIRECT_BAD = [
    ("block 0", (torch.float32, 0, torch.float8_e4m3fn, "amax"), ValueError, "block_size"),
    ("block 3", (torch.float32, 3, torch.float8_e4m3fn, "amax"), ValueError, "block_size"),
    ("block -128", (torch.float32, -128, torch.float8_e4m3fn, "amax"), ValueError, "block_size"),
    ("block 2**62", (torch.float32, 2**62, torch.float8_e4m3fn, "amax"), ValueError, "block_size"),
    ("fp8 fp16", (torch.float32, 128, torch.float16, "amax"), TypeError, "fp8_dtype"),
    ("x fp64", (torch.float64, 128, torch.float8_e4m3fn, "amax"), TypeError, "x must be"),
    ("mode", (torch.float32, 128, torch.float8_e4m3fn, "ceil"), ValueError, "scale_mode"),
]


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
@pytest.mark.parametrize("args,exc,match", [c[1:] for c in _DIRECT_BAD],
                         ids=[c[0] for c in _DIRECT_BAD])
def test_quantize_blocks_op_bad_args(args, exc, match, fake):
    """The direct op (``qmoe.quantize`` checks its recipe first) refuses what would divide
    by zero, overflow the block count or pick an undefined mode, on this machine's CPU
    backend (C++ or torch) and in its fake alike."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    dtype, bs, fp8, mode = args
    x = torch.randn(3, 256, dtype=dtype)
    mode_ctx = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    with mode_ctx, pytest.raises(exc, match=match):
        torch.ops.qmoe.quantize_blocks(x, bs, fp8, mode)
    if exc is TypeError:  # the sibling op takes the same dtypes
        with mode_ctx, pytest.raises(exc, match=match):
            torch.ops.qmoe.quantize_with_scale(x, torch.tensor(0.5), fp8)


def test_constructor_checks():
    q8 = torch.zeros(4, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="scale shape"):
        qmoe.Float8BlockwiseTensor(q8, torch.ones(4, 3), torch.bfloat16, 128)
    with pytest.raises(TypeError, match="qdata must be"):
        qmoe.Float8Tensor(torch.zeros(4, 4), torch.tensor(1.0), torch.bfloat16)
    with pytest.raises(TypeError, match="scale must be"):
        qmoe.MXFP8Tensor(q8, torch.ones(4, 8), torch.bfloat16)
    with pytest.raises(TypeError, match="orig_dtype"):
        qmoe.Float8Tensor(q8, torch.tensor(1.0), torch.int32)


@pytest.mark.parametrize("t", [7, 0])
def test_quantize_ops_opcheck(t):
    """The three quantize ops pass opcheck (fake = real, schema, dispatch), empty input
    included. They carry no autograd registration (``qmoe.quantize``'s autograd function
    gives the gradient), so their inputs need no grad here."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(t, 300, device=dev, dtype=torch.bfloat16)
    for bs, dt, mode in ((128, torch.float8_e4m3fn, "amax"), (128, torch.float8_e5m2, "pow2"),
                         (32, torch.float8_e4m3fn, "mx_floor")):
        torch.library.opcheck(torch.ops.qmoe.quantize_blocks.default, (x, bs, dt, mode))
    scale = torch.tensor(0.02, device=dev)
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        torch.library.opcheck(torch.ops.qmoe.quantize_with_scale.default, (x, scale, dt))
        torch.library.opcheck(torch.ops.qmoe.per_tensor_scale.default,
                              (x, fp8_max(dt), dt == torch.float8_e5m2))

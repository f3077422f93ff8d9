"""The Triton quantize kernel against the torch reference, bit for bit.

Runs on CUDA, or on CPU under TRITON_INTERPRET=1 (where the kernel's integer fp8
rounding replaces the hardware cast).
"""

import pytest
import torch

import qmoe
from qmoe.tensors.quantize import (
    _reference_blocks,
    _saturate_cast,
    quantize_rows_triton,
    scale_dtype,
)
from tests.tensors.helpers import (
    RECIPES,
    assert_same_bits,
    rceil_inputs,
    rceil_reference,
    tiny_mx_blocks,
)

MODES = [
    ("amax", 128), ("pow2", 128), ("mx_floor", 32), ("mx_rceil", 32), ("amax", 32),
    ("pow2", 64),
]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _nasty(rows: int, h: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows spanning 60 orders of magnitude, plus zero rows, NaN, inf and ties."""
    x = torch.randn(rows, h) * torch.logspace(-30, 30, rows)[:, None]
    x[min(1, rows - 1)] = 0.0
    if rows > 3 and h > 2:
        x[2, 1] = float("nan")
        x[3, 0] = float("inf")
    return x.to(dtype)


def _poisoned_run(x, bs, fp8, mode):
    """Run the kernel into outputs pre-filled with 0xFF, so unwritten bytes show up
    (0xFF is NaN in both fp8 formats and in e8m0, and the reference has no NaN here)."""
    nb = -(-x.shape[-1] // bs)
    q = torch.full(x.shape, 0xFF, dtype=torch.uint8, device=x.device).view(fp8)
    sdt = scale_dtype(mode)
    s = torch.full((*x.shape[:-1], nb), 0xFF, dtype=torch.uint8, device=x.device)
    s = s if sdt == torch.uint8 else torch.full(s.shape, float("nan"), device=x.device)
    return quantize_rows_triton(x, bs, fp8, mode, out=(q, s))


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("mode,bs", MODES)
@pytest.mark.parametrize("h", [1, 17, 127, 129, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_reference(kdevice, fp8, mode, bs, h, dtype):
    if dtype == torch.float16:
        x = torch.randn(9, h).to(dtype) * 100
    else:
        x = _nasty(9, h, dtype)
    x = x.to(kdevice)
    q, s = quantize_rows_triton(x, bs, fp8, mode)
    qr, sr = _reference_blocks(x.cpu(), bs, fp8, mode)
    assert_same_bits(q.cpu(), qr)
    assert_same_bits(s.cpu(), sr)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("mode,bs", [("amax", 128), ("pow2", 128), ("mx_floor", 32),
                                     ("mx_rceil", 32)])
def test_kernel_bf16_subnormal_inputs(kdevice, fp8, mode, bs):
    """bf16 inputs below 2**-126 (bf16 subnormals), in whole rows and alone in a row's last
    block, quantize to the reference's bits (the interpreter's own bf16 -> fp32 conversion
    misreads them; the kernels widen bf16 through its bits there)."""
    h = 3 * bs + 1  # the last block holds one element
    x = (torch.randn(6, h) * torch.logspace(-40, -38.5, 6)[:, None]).clamp(-1e-38, 1e-38)
    x[:, -1] = torch.tensor([2.0**-133, -(2.0**-130), 1e-39, 0.0, 2.0**-127, -3e-40])
    x = x.to(torch.bfloat16)
    assert (x.float().abs() < 2.0**-126).all() and (x != 0).sum() > x.numel() // 2
    q, s = _poisoned_run(x.to(kdevice), bs, fp8, mode)
    qr, sr = _reference_blocks(x, bs, fp8, mode)
    assert_same_bits(q.cpu(), qr)
    assert_same_bits(s.cpu(), sr)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_mx_tiny_blocks(kdevice, fp8, dtype):
    """Nonzero MX blocks below the OCP exponent -126 store byte 1, the divisor 2**-126
    the kernel used, and dequantize exactly; all-zero blocks store byte 0."""
    x, want = tiny_mx_blocks(fp8, dtype)
    q, s = _poisoned_run(x.to(kdevice), 32, fp8, "mx_floor")
    assert_same_bits(s.cpu(), want)
    assert torch.equal(qmoe.MXFP8Tensor(q.cpu(), s.cpu(), dtype).dequantize(), x)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_mx_rceil_edges(kdevice, fp8, dtype):
    """TE's RCEIL rule in the kernel: amaxes at and around every power-of-two edge,
    subnormal quotients, zeros, inf and NaN, against the reference from its definition."""
    x = rceil_inputs(fp8, dtype)
    q, s = _poisoned_run(x.to(kdevice), 32, fp8, "mx_rceil")
    want_q, want_s = rceil_reference(x, fp8)
    assert_same_bits(s.cpu(), want_s)
    assert_same_bits(q.cpu().view(torch.uint8), want_q)


@pytest.mark.parametrize("fp8", FP8)
def test_kernel_fp8_rounding_every_magnitude(kdevice, fp8):
    """Per-tensor path with scale 1: the fp8 cast itself, over normals, subnormals, ties."""
    mags = torch.logspace(-45, 6, 20000)
    x = torch.cat([
        torch.randn(20000) * mags,
        # exact ties between fp8 neighbours: k/16 * 2**e for e4m3, k/8 for e5m2
        torch.arange(-512, 512) / 16.0 * 2.0 ** torch.randint(-20, 8, (1024,)),
        torch.tensor([0.0, -0.0, 448.0, -448.0, 464.0, 57344.0, 61440.0, 1e30, -1e30,
                      float("inf"), float("-inf"), 2.0**-9, 2.0**-10, 3 * 2.0**-11,
                      2.0**-16, 2.0**-17, 3 * 2.0**-18, 1e-45]),
    ]).reshape(1, -1).to(kdevice)
    one = torch.ones((), device=kdevice)
    q, _ = quantize_rows_triton(x, 512, fp8, "given", one)
    assert_same_bits(q.cpu(), _saturate_cast(x.cpu(), fp8))


@pytest.mark.parametrize("rows", [1, 63, 1025])
def test_kernel_row_tails_and_leading_dims(kdevice, rows):
    x = torch.randn(rows, 3, 200, dtype=torch.bfloat16, device=kdevice)
    for mode, bs in [("amax", 128), ("mx_floor", 32)]:
        q, s = _poisoned_run(x, bs, torch.float8_e4m3fn, mode)
        qr, sr = _reference_blocks(x.cpu(), bs, torch.float8_e4m3fn, mode)
        assert q.shape == (rows, 3, 200) and s.shape == sr.shape
        assert_same_bits(q.cpu(), qr)
        assert_same_bits(s.cpu(), sr)


@pytest.mark.parametrize("shape", [(0, 256), (5, 0), (0, 0), (2, 3, 0), (2, 0, 64)])
def test_kernel_empty(kdevice, shape):
    """No rows or no columns (H = 0: ``reshape(-1, 0)`` cannot infer the rows): correctly
    shaped empty outputs, no launch."""
    x = torch.randn(shape, device=kdevice)
    for bs, mode, sdt in ((128, "amax", torch.float32), (128, "pow2", torch.float32),
                          (32, "mx_floor", torch.uint8), (32, "mx_rceil", torch.uint8)):
        q, s = quantize_rows_triton(x, bs, torch.float8_e4m3fn, mode)
        assert q.shape == shape and q.dtype == torch.float8_e4m3fn
        assert s.shape == (*shape[:-1], -(-shape[-1] // bs)) and s.dtype == sdt
    given = torch.tensor(0.5, device=kdevice)
    q, s = quantize_rows_triton(x, 512, torch.float8_e5m2, "given", given)
    assert q.shape == shape and q.dtype == torch.float8_e5m2 and s is given


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA dispatch of qmoe.quantize")
@pytest.mark.parametrize("name", list(RECIPES))
def test_quantize_on_cuda_matches_cpu(name):
    x = _nasty(64, 7168, torch.bfloat16)
    qc = qmoe.quantize(x.cuda(), RECIPES[name])
    qr = qmoe.quantize(x, RECIPES[name])
    assert_same_bits(qc.qdata.cpu(), qr.qdata)
    assert_same_bits(qc.raw_scale.cpu(), qr.raw_scale)


def _same_bits_or_both_nan(a, b):
    """Bits equal where ``b`` is not NaN; NaN where it is (the GPU's bf16 NaN is 0x7FFF,
    torch's cast gives 0x7FC0)."""
    a, b = a.cpu(), b.cpu()
    nan = b.isnan()
    assert torch.equal(a.isnan(), nan)
    assert_same_bits(torch.where(nan, 0, a), torch.where(nan, 0, b))


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("recipe", ["per_tensor", "block32", "block128", "rowwise", "mx"])
@pytest.mark.parametrize("shape", [(1, 1), (9, 17), (3, 5, 300), (40, 1030)])
def test_dequantize_kernel_matches_torch(kdevice, fp8, dtype, recipe, shape):
    """``dequantize_rows_kernel``: bit for bit torch's ``qdata.float() * scale`` then
    ``.to(dtype)`` (NaN as NaN), per-tensor and block scales (MX's e8m0 as fp32), every fp8
    bit pattern among the inputs, into a poisoned output."""
    from qmoe.tensors.base import expand_block_scales
    from qmoe.tensors.quantize import dequantize_rows_triton

    h = shape[-1]
    q = torch.randint(0, 256, shape, dtype=torch.uint8).view(fp8).to(kdevice)
    bs = {"per_tensor": h, "block32": 32, "block128": 128, "rowwise": 1 << (h - 1).bit_length(),
          "mx": 32}[recipe]
    nb = -(-h // bs)
    if recipe == "per_tensor":
        scale = torch.tensor(0.37, device=kdevice)
    elif recipe == "mx":  # e8m0 bytes as fp32, byte 0 (2**-127) and 255 (NaN) among them
        from qmoe.tensors.base import e8m0_to_fp32

        b = torch.randint(100, 150, (*shape[:-1], nb), dtype=torch.uint8)
        b.view(-1)[:2] = torch.tensor([0, 255], dtype=torch.uint8)[: b.numel()]
        scale = e8m0_to_fp32(b).to(kdevice)
    else:
        scale = (torch.rand(*shape[:-1], nb) * 10.0 ** torch.randint(-30, 30, (1,))).to(kdevice)
    out = torch.full(shape, float("nan"), dtype=dtype, device=kdevice)
    dequantize_rows_triton(q, scale, bs, dtype, out=out)
    full = scale if recipe == "per_tensor" else expand_block_scales(scale, h, bs)
    _same_bits_or_both_nan(out, (q.float() * full).to(dtype))


def test_dequantize_op_and_tensors():
    """``qmoe::dequantize_blocks`` passes opcheck; each quantized type's ``dequantize``
    gives the torch form's bits on this device (CUDA: through the op)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(33, 300, device=dev).bfloat16()
    for recipe in [*RECIPES.values(), qmoe.RowWise()]:
        t = qmoe.quantize(x, recipe)
        want = t.qdata.float() * t._scale_full()
        _same_bits_or_both_nan(t.dequantize(), want.to(torch.bfloat16))
        _same_bits_or_both_nan(t.dequantize(torch.float32), want)
    q = qmoe.quantize(x, qmoe.Blockwise())
    bits = q.qdata.view(torch.uint8)
    torch.library.opcheck(torch.ops.qmoe.dequantize_blocks.default,
                          (bits, q.fp8_dtype, q.scale_fp32(), 128, torch.bfloat16))
    with pytest.raises(ValueError, match="scale must be"):
        torch.ops.qmoe.dequantize_blocks(bits, q.fp8_dtype, q.scale_fp32()[:, :1], 128,
                                         torch.bfloat16)
    # dtypes the op does not take keep the torch form on every device
    for t in (q, qmoe.quantize(x, qmoe.PerTensor())):
        assert torch.equal(t.dequantize(torch.float64),
                           (t.qdata.float() * t._scale_full()).double())

"""``qmoe.swiglu`` and its kernels: the activation against fp64 (one rounding), the fused
quantize bit for bit ``quantize_blocks`` of the activation, the backward against fp64
autograd, poisoned outputs, awkward sizes, opcheck, bad input."""

import pytest
import torch
import torch.nn.functional as F

import qmoe
from qmoe.ops.kernels.swiglu import swiglu_backward_triton, swiglu_triton
from qmoe.tensors.quantize import scale_dtype
from tests.tensors.helpers import assert_same_bits

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = [(1, 1), (63, 17), (9, 300), (130, 64), (5, 1030)]  # (N, F)


def _h(n, f, dtype, device):
    h = torch.randn(n, 2 * f, device=device) * 3
    if n > 2 and f > 2:
        h[1, 0] = 30.0  # silu ~ a
        h[2, 1] = -90.0  # exp(-a) overflows: silu -> -0
    return h.to(dtype)


def _truth(h):
    a, b = h.double().chunk(2, dim=-1)
    return F.silu(a) * b


def _assert_close_to(got, truth, dtype, scale=None):
    """Within one rounding of ``dtype`` (plus fp32 math error) of the fp64 truth, relative
    to ``scale`` (default ``|truth|``; a gradient whose terms cancel passes its terms'
    magnitude)."""
    # fp32: a few units in the last place (the GPU's exponential is approximate)
    rel = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-17
    scale = truth.abs() if scale is None else scale
    err = (got.double().cpu() - truth.cpu()).abs()
    assert (err <= rel * scale.cpu() + 1e-30).all(), (err - rel * scale.cpu()).max()


def _grad_scale(h, g):
    """The magnitude of the backward's terms: ``|g b s| (1 + |a| (1 - s))`` and ``|g a s|``,
    fp64."""
    a, b = h.double().cpu().chunk(2, dim=-1)
    s = torch.sigmoid(a)
    g = g.double().cpu().abs()
    return torch.cat([g * b.abs() * s * (1 + a.abs() * (1 - s)), g * (a * s).abs()], -1)


@pytest.mark.parametrize("n,f", SIZES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_activation(kdevice, n, f, dtype):
    """One rounding of the fp32 math: the bf16 output is the fp32 output rounded (the
    interpreter's bit rounding equals torch's cast), both near fp64; poisoned output."""
    h = _h(n, f, dtype, kdevice)
    out = torch.full((n, f), float("nan"), dtype=dtype, device=kdevice)
    swiglu_triton(h, out=out)
    _assert_close_to(out, _truth(h), dtype)
    if dtype == torch.bfloat16:
        assert_same_bits(out, swiglu_triton(h.float()).to(dtype))


@pytest.mark.parametrize("mode,bs", [("amax", 128), ("amax", None), ("pow2", 32),
                                     ("mx_floor", 32), ("mx_rceil", 32)])
@pytest.mark.parametrize("n,f", SIZES)
def test_kernel_quantize_is_quantize_of_activation(kdevice, mode, bs, n, f):
    """The fused form's bits and scales are ``quantize_blocks`` of the activation the plain
    form writes (``bs`` None: one block a row, RowWise), into poisoned outputs."""
    from qmoe._intmath import next_pow2

    bs = next_pow2(f) if bs is None else bs
    fp8 = torch.float8_e4m3fn
    h = _h(n, f, torch.bfloat16, kdevice)
    nb = -(-f // bs)
    q = torch.full((n, f), 0xFF, dtype=torch.uint8, device=kdevice).view(fp8)
    sd = scale_dtype(mode)
    s = (torch.full((n, nb), 0xFF, dtype=torch.uint8, device=kdevice) if sd == torch.uint8
         else torch.full((n, nb), float("nan"), device=kdevice))
    swiglu_triton(h, (bs, fp8, mode), out=(q, s))
    want_q, want_s = torch.ops.qmoe.quantize_blocks(swiglu_triton(h).cpu(), bs, fp8, mode)
    assert_same_bits(q, want_q)
    assert_same_bits(s, want_s)


@pytest.mark.parametrize("n,f", SIZES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_backward(kdevice, n, f, dtype):
    """``grad_h`` against fp64 autograd of ``silu(a) * b``, into a poisoned output; a
    strided gradient."""
    h = _h(n, f, dtype, kdevice)
    g = torch.randn(n, 2 * f, device=kdevice).to(dtype)[:, :f]  # row stride 2F
    out = torch.full((n, 2 * f), float("nan"), dtype=dtype, device=kdevice)
    swiglu_backward_triton(g, h, out=out)
    hd = h.double().cpu().requires_grad_()
    _truth(hd).backward(g.double().cpu())
    _assert_close_to(out, hd.grad, dtype, _grad_scale(h, g))


def test_ops_opcheck_and_device_paths_agree():
    """opcheck of the three ops; on this device each equals the kernel (CUDA) or the torch
    path (CPU) within one rounding of fp64, and the fused quantize is the quantize of the
    activation the op returns."""
    h = _h(40, 48, torch.bfloat16, DEV)
    g = torch.randn(40, 48, device=DEV).bfloat16()
    torch.library.opcheck(torch.ops.qmoe.swiglu.default, (h,))
    torch.library.opcheck(torch.ops.qmoe.swiglu_quantize.default,
                          (h, 64, torch.float8_e4m3fn, "amax"))
    torch.library.opcheck(torch.ops.qmoe.swiglu_backward.default, (g, h))
    act = torch.ops.qmoe.swiglu(h)
    _assert_close_to(act, _truth(h), torch.bfloat16)
    q, s = torch.ops.qmoe.swiglu_quantize(h, 64, torch.float8_e4m3fn, "amax")
    wq, ws = torch.ops.qmoe.quantize_blocks(act, 64, torch.float8_e4m3fn, "amax")
    assert_same_bits(q, wq)
    assert_same_bits(s, ws)


@pytest.mark.parametrize("recipe,dtype", [
    (None, torch.bfloat16), (None, torch.float32), (qmoe.RowWise(), torch.bfloat16),
    (qmoe.Blockwise(block_size=32), torch.float32), (qmoe.MXFP8(), torch.bfloat16),
    (qmoe.PerTensor(), torch.bfloat16)])
def test_public_swiglu_forward_and_grad(recipe, dtype):
    """``qmoe.swiglu``: the value (quantized: ``qmoe.quantize`` of the plain activation,
    bit for bit), and a gradient passing straight through the quantize, against fp64; h
    left as it was (fp32 too: the torch path works in place on its own copy)."""
    h0 = _h(70, 40, dtype, DEV)
    h_before = h0.clone()
    h = h0.clone().requires_grad_()
    out = qmoe.swiglu(h, quantize=recipe)
    plain = qmoe.swiglu(h0)
    if recipe is None:
        _assert_close_to(out.detach(), _truth(h0), dtype)
    else:
        want = qmoe.quantize(plain, recipe)
        assert type(out) is type(want)
        assert_same_bits(out.qdata, want.qdata)
        assert_same_bits(out.raw_scale if recipe != qmoe.PerTensor() else out.scale,
                         want.raw_scale if recipe != qmoe.PerTensor() else want.scale)
    g = torch.randn(70, 40, device=DEV).to(dtype)
    out.backward(g)
    hd = h0.double().requires_grad_()
    _truth(hd).backward(g.double())
    _assert_close_to(h.grad, hd.grad, dtype, _grad_scale(h0, g))
    assert_same_bits(h.detach(), h_before)


def test_compile_fullgraph():
    """forward + backward of ``swiglu(h, quantize=RowWise())`` under
    ``torch.compile(fullgraph=True)``: the eager bits."""
    h0 = _h(33, 24, torch.bfloat16, DEV)
    g = torch.randn(33, 24, device=DEV).bfloat16()

    def f(h):
        return qmoe.swiglu(h, quantize=qmoe.RowWise()).dequantize(torch.bfloat16)

    outs = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        h = h0.clone().requires_grad_()
        y = fn(h)
        y.backward(g)
        outs.append((y.detach(), h.grad))
    for a, b in zip(*outs):
        assert_same_bits(a, b)


def test_bad_input():
    with pytest.raises(ValueError, match=r"h must be \[N, 2F\]"):
        qmoe.swiglu(torch.zeros(4, 5, device=DEV).bfloat16())
    with pytest.raises(TypeError, match="h must be bf16 or fp32"):
        qmoe.swiglu(torch.zeros(4, 6, device=DEV).half())
    with pytest.raises(TypeError, match="quantize must be None or a qmoe recipe"):
        qmoe.swiglu(torch.zeros(4, 6, device=DEV), quantize="rowwise")
    with pytest.raises(TypeError, match="h must be a plain"):
        qmoe.swiglu(qmoe.quantize(torch.zeros(4, 6, device=DEV), qmoe.RowWise()))
    with pytest.raises(ValueError, match=r"grad must be \[N, F\]"):
        torch.ops.qmoe.swiglu_backward(torch.zeros(4, 4, device=DEV),
                                       torch.zeros(4, 6, device=DEV))

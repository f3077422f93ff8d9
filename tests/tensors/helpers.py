import torch

import qmoe

RECIPES = {
    "pertensor-e4m3": qmoe.PerTensor(),
    "pertensor-e5m2": qmoe.PerTensor(torch.float8_e5m2),
    "pertensor-pow2": qmoe.PerTensor(power_of_two_scale=True),
    "blockwise-e4m3": qmoe.Blockwise(),
    "blockwise-e5m2": qmoe.Blockwise(fp8_dtype=torch.float8_e5m2),
    "blockwise-pow2": qmoe.Blockwise(power_of_two_scale=True),
    "mx-e4m3": qmoe.MXFP8(),
    "mx-e5m2": qmoe.MXFP8(torch.float8_e5m2),
}
# One recipe per layout, for the tests where the fp8 dtype is not the point.
LAYOUTS = {k: RECIPES[k] for k in ("pertensor-e4m3", "blockwise-e4m3", "mx-e4m3")}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a tensor, for bit-exact comparison (NaN == NaN)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def on_bytes(fn, t: torch.Tensor) -> torch.Tensor:
    """``fn(t)`` computed on a uint8 view of 1-byte data and viewed back (torch 2.9's CPU
    index kernels do not take fp8 / e8m0)."""
    return fn(t.view(torch.uint8)).view(t.dtype) if t.element_size() == 1 else fn(t)


def take_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t.index_select(0, index)`` for any dtype (``on_bytes``)."""
    return on_bytes(lambda u: u.index_select(0, index), t)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.device != b.device:  # e.g. CUDA output against a CPU reference: same bytes
        a, b = a.cpu(), b.cpu()
    ba, bb = bits(a), bits(b)
    if not torch.equal(ba, bb):
        bad = (ba != bb).nonzero().flatten()
        raise AssertionError(
            f"bits differ at {bad.numel()} of {ba.numel()} bytes; first byte offsets "
            f"{bad[:6].tolist()}: {ba[bad[:6]].tolist()} vs {bb[bad[:6]].tolist()}"
        )


def assert_same_quantized(a, b) -> None:
    assert type(a) is type(b)
    assert a._attrs() == b._attrs()
    assert_same_bits(a.qdata, b.qdata)
    assert_same_bits(a.raw_scale, b.raw_scale)


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return (20 * torch.log10(x.norm() / (x - y).norm())).item()


def tiny_mx_blocks(fp8: torch.dtype, dtype: torch.dtype = torch.float32):
    """``(x [3, 64], want)``: MX blocks whose amax is below ``2**-118`` (e4m3) or
    ``2**-111`` (e5m2), where the OCP exponent ``floor(log2(amax)) - emax_elem`` falls below
    -126, beside all-zero blocks (``+0`` and ``-0``) and blocks at that bound. Every value
    is exact after quantization with the divisor ``2**-126``; ``want`` is each block's e8m0
    byte: 1 (``2**-126``, the divisor used) for a nonzero block, 0 for an all-zero one."""
    v = 2.0**-120 if fp8 == torch.float8_e4m3fn else 2.0**-113
    edge = 2.0**-118 if fp8 == torch.float8_e4m3fn else 2.0**-111
    x = torch.zeros(3, 64)
    x[0, :32] = v
    x[1, :32] = torch.tensor([v, -(2.0**-125), 2.0**-125, -v] * 8)
    x[1, 32:] = -0.0
    x[2, :32] = torch.tensor([2.0**-130, -(2.0**-133), 2.0**-127, 0.0] * 8)  # fp32 subnormals
    x[2, 32:] = edge
    want = torch.tensor([[1, 0], [1, 0], [1, 1]], dtype=torch.uint8)
    return x.to(dtype), want

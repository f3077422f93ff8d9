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
    "mx-rceil-e4m3": qmoe.MXFP8(scale_rounding="rceil"),
    "rowwise-e4m3": qmoe.RowWise(),
    "rowwise-e5m2-pow2": qmoe.RowWise(torch.float8_e5m2, power_of_two_scale=True),
}


def skip_wide_rowwise(recipe, h: int) -> None:
    """Skip a case of rows wider than ``RowWise`` covers (16384 columns; its refusal is
    tested in tests/tensors/test_quantize.py)."""
    import pytest

    if isinstance(recipe, qmoe.RowWise) and h > 16384:
        pytest.skip(f"RowWise covers rows of up to 16384 columns, not H={h}")


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


def rceil_inputs(fp8: torch.dtype, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[R, 64]``: MX blocks whose amax sits on and around TransformerEngine's RCEIL edges,
    each block's amax at a random column, the rest random fractions of it with random
    signs. Block 0 of the rows takes ``fp8_max * 2**k`` and its fp32 neighbours for every
    k in range (descales at, just above and just below a power of two), then amaxes
    around ``fp8_max * 2**-127`` (a subnormal descale rounded to 2**-127, or above), fp32
    subnormals, the largest float; block 1 is ordinary. Then rows of zeros, -0, an inf
    and a NaN (set after the cast to ``dtype``)."""
    m = float(torch.finfo(fp8).max)
    amax = []
    for k in range(-150, 128):
        base = torch.tensor(m * 2.0**k, dtype=torch.float32)
        if base.item() == 0 or not torch.isfinite(base):
            continue
        bits = base.view(torch.int32).item()
        amax += torch.arange(bits - 2, bits + 3, dtype=torch.int32).view(torch.float32).tolist()
    edge = torch.tensor(m * 2.0**-127, dtype=torch.float32).view(torch.int32).item()
    amax += torch.arange(edge, edge + 40, 4, dtype=torch.int32).view(torch.float32).tolist()
    amax += [2.0**-149, 1e-40, 2.0**-126, torch.finfo(torch.float32).max]
    a = torch.tensor(amax, dtype=torch.float32)
    a = a[torch.isfinite(a) & (a > 0)]
    r = a.numel()
    x = torch.rand(r, 64) * torch.where(torch.rand(r, 64) < 0.5, -1.0, 1.0)
    x[:, :32] *= a[:, None]
    x[:, 32:] *= 10.0
    x[torch.arange(r), torch.randint(0, 32, (r,))] = a * torch.where(torch.rand(r) < 0.5, -1, 1)
    x = torch.cat([x, torch.randn(4, 64)]).to(dtype)
    x[r] = 0.0
    x[r + 1] = -0.0
    x[r + 2, 5] = float("inf")
    x[r + 3, 40] = float("nan")
    return x


def rceil_reference(x: torch.Tensor, fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 bits, e8m0 bytes)`` as ``uint8`` of TransformerEngine's RCEIL MXFP8 rule for
    ``x`` ``[R, H]`` (H a multiple of 32), from its definition with Python and numpy
    scalars: the byte is ``ceil(log2(d))`` (exact, by ``math.frexp``) of the fp32 quotient
    ``d = amax / fp8_max`` (numpy's IEEE division), clamped to [0, 254] (254 for an infinite
    amax), 255 for NaN; elements are ``x * 2**(127 - byte)`` in float64 (``x`` itself for
    byte 0, all NaN for 255), saturated to +-fp8_max and rounded to fp8 (NaN as 0x7F)."""
    import math

    import numpy as np

    fmax = float(torch.finfo(fp8).max)
    xf = x.float()
    r, h = xf.shape
    blocks = xf.reshape(r, h // 32, 32)
    nbytes = torch.empty(r, h // 32, dtype=torch.uint8)
    mult = torch.empty(r, h // 32, dtype=torch.float64)
    for (i, j), vals in zip(np.ndindex(r, h // 32), blocks.reshape(-1, 32).tolist()):
        if any(math.isnan(v) for v in vals):
            b = 255
        else:
            with np.errstate(over="ignore"):
                d = float(np.float32(max(abs(v) for v in vals)) / np.float32(fmax))
            if math.isinf(d):
                b = 254
            elif d == 0:
                b = 0
            else:
                mant, ex = math.frexp(d)  # d = mant * 2**ex, mant in [0.5, 1)
                b = min(max((ex - 1 if mant == 0.5 else ex) + 127, 0), 254)
        nbytes[i, j] = b
        mult[i, j] = math.nan if b == 255 else 1.0 if b == 0 else 2.0 ** (127 - b)
    y = (blocks.double() * mult[..., None]).clamp(-fmax, fmax).reshape(r, h)
    q = y.float().to(fp8).view(torch.uint8)
    return torch.where(y.isnan(), 0x7F, q).to(torch.uint8), nbytes

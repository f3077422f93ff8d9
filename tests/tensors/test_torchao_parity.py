"""MX quantization against torchao's MXTensor.to_mx, FLOOR and RCEIL modes, bit for bit.

FLOOR's one documented difference (docs/tensors.md): a nonzero block whose OCP exponent
``floor(log2(amax)) - emax_elem`` falls below -126 (amax < 2**-118 for e4m3, 2**-111 for
e5m2). Both divide its elements by 2**-126 (the same fp8 bits); torchao stores the scale
byte 0 (2**-127), which dequantizes them at half their value, qmoe byte 1 (2**-126).
"""

import pytest
import torch

import qmoe
from tests.tensors.helpers import assert_same_bits, rceil_inputs, tiny_mx_blocks

mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")


def _inputs(fp8, dtype):
    x = torch.randn(64, 256) * torch.logspace(-35, 35, 64)[:, None]
    x[8:11, :64] = tiny_mx_blocks(fp8)[0]
    x = x.to(dtype)
    # set after the cast: torch's vectorized fp32 -> bf16 cast makes NaN negative (0xFFFF),
    # and torchao keeps a NaN's sign where qmoe writes the positive NaN 0x7F
    x[3] = 0.0
    x[5, 7] = float("nan")
    x[6, 0] = float("inf")
    return x


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mx_matches_torchao_to_mx(fp8, dtype):
    x = _inputs(fp8, dtype)
    scale, data = mx_tensor.to_mx(x, fp8, 32)
    q = qmoe.quantize(x, qmoe.MXFP8(fp8))
    assert_same_bits(q.qdata, data)
    amax = x.float().reshape(64, 8, 32).abs().amax(-1)
    below = (amax > 0) & (amax < (2.0**-118 if fp8 == torch.float8_e4m3fn else 2.0**-111))
    assert below[8:11, :2].tolist() == [[True, False]] * 3  # tiny_mx_blocks' nonzero ones
    theirs = scale.view(torch.uint8).reshape(64, 8)
    assert (theirs[below] == 0).all()  # the exception: torchao's byte 0 there ...
    assert (q.scale_bits[below] == 1).all()  # ... qmoe's byte 1, the divisor both used
    assert_same_bits(q.scale_bits[~below], theirs[~below])  # every other block


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mx_rceil_matches_torchao_to_mx(fp8, dtype):
    """``scale_rounding="rceil"`` against torchao's RCEIL (its eager fallback on CPU), on
    inputs at and around every power-of-two edge (``rceil_inputs``) and the FLOOR test's.

    One exception, torchao's: it takes ``ceil(log2(d))`` of ``d = amax / fp8_max`` in fp32,
    and ``torch.log2`` rounds a ``d`` a few ulps above ``2**k`` to ``k`` exactly, so torchao
    stores byte ``k + 127`` there and saturates the amax element, where TE's rounding
    (and ``cvt.rp.satfinite.ue8m0x2.f32``, which torchao uses on Blackwell under compile)
    gives ``k + 128``, as qmoe does. Only fp32 inputs come that close to a power of two."""
    x = torch.cat([rceil_inputs(fp8, dtype), _inputs(fp8, dtype).reshape(-1, 64)])
    r, nb = x.shape[0], x.shape[1] // 32
    scale, data = mx_tensor.to_mx(x.reshape(-1, 32), fp8, 32,
                                  scaling_mode=mx_tensor.ScaleCalculationMode.RCEIL)
    q = qmoe.quantize(x, qmoe.MXFP8(fp8, scale_rounding="rceil"))
    d = x.float().reshape(r, nb, 32).abs().amax(-1) / torch.finfo(fp8).max
    lg = torch.log2(d)
    short = (lg == lg.round()) & (d > torch.exp2(lg))  # torchao's log2 lands on k
    assert short.any() == (dtype == torch.float32)
    ours, theirs = q.scale_bits, scale.view(torch.uint8).reshape(r, nb)
    assert_same_bits(ours[~short], theirs[~short])
    assert (ours[short] == theirs[short] + 1).all()
    qb, tb = q.qdata.reshape(r, nb, 32), data.reshape(r, nb, 32)
    assert_same_bits(qb[~short], tb[~short])

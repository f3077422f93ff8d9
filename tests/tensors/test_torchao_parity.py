"""MX quantization against torchao's MXTensor.to_mx, FLOOR and RCEIL modes, bit for bit.

One documented difference (docs/tensors.md): a nonzero block whose OCP exponent
``floor(log2(amax)) - emax_elem`` falls below -126 (amax < 2**-118 for e4m3, 2**-111 for
e5m2). Both divide its elements by 2**-126 (the same fp8 bits); torchao stores the scale
byte 0 (2**-127), which dequantizes them at half their value, qmoe byte 1 (2**-126).
"""

import pytest
import torch

import qmoe
from tests.tensors.helpers import assert_same_bits, tiny_mx_blocks

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

"""MX scale rounding matches torchao's MXTensor.to_mx (FLOOR mode) bit for bit."""

import pytest
import torch

import qmoe
from tests.tensors.helpers import assert_same_bits

mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mx_matches_torchao_to_mx(fp8, dtype):
    x = (torch.randn(64, 256) * torch.logspace(-35, 35, 64)[:, None]).to(dtype)
    x[3] = 0.0
    x[5, 7] = float("nan")
    x[6, 0] = float("inf")
    scale, data = mx_tensor.to_mx(x, fp8, 32)
    q = qmoe.quantize(x, qmoe.MXFP8(fp8))
    assert_same_bits(q.scale, scale.reshape(q.scale.shape))
    assert_same_bits(q.qdata, data)

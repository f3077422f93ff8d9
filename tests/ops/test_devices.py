"""Ops on a CUDA device other than the current one launch on the tensors' device.

Triton launches on the current device and stream, not on its arguments' device; every
``qmoe::`` op runs with the current device set to its first tensor's
(``qmoe._library.on_input_device``). Needs two GPUs (``nvidia-h200-x2``).
"""

import pytest
import torch

import qmoe
from qmoe.ops import reference as R
from tests.ops.helpers import routing
from tests.tensors.helpers import assert_same_bits

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


def test_ops_on_the_second_gpu_while_the_first_is_current():
    torch.cuda.set_device(0)
    dev = "cuda:1"
    t, h, e, k = 300, 256, 16, 4
    ids, mask = routing(t, e, k, "sentinels", dev)
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    probs = torch.rand(t, e, device=dev)
    n = int(mask.sum()) - 7  # a few dropped routes
    out, pp, rid = qmoe.moe_permute_with_probs(x, probs, mask, n)
    want, pp_w, _ = R.permute(x.cpu(), mask.cpu(), "mask", n, probs.cpu())
    assert out.device == x.device
    assert_same_bits(out.cpu(), want)
    assert_same_bits(pp.cpu(), pp_w)
    oi, _ = qmoe.moe_permute(x, ids, n, map_type="index")
    assert_same_bits(oi.cpu(), want)
    y = qmoe.moe_unpermute(out, rid, probs)
    ref = R.unpermute(out.cpu().double(), mask.cpu(), "mask", probs.cpu().double(), n)
    mag = R.unpermute(out.cpu().double().abs(), mask.cpu(), "mask", probs.cpu().double(), n)
    assert ((y.double().cpu() - ref).abs() <= 2**-8 * ref.abs() + 2**-20 * mag).all()
    q = qmoe.quantize(x, qmoe.Blockwise())
    qo, _ = qmoe.moe_permute(q, mask, n)
    qw, _ = qmoe.moe_permute(qmoe.quantize(x.cpu(), qmoe.Blockwise()), mask.cpu(), n)
    assert_same_bits(qo.qdata.view(torch.uint8).cpu(), qw.qdata.view(torch.uint8))
    assert_same_bits(qo.raw_scale.cpu(), qw.raw_scale)
    assert torch.cuda.current_device() == 0

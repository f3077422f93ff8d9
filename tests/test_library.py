"""``qmoe._library``: an eager call on plain CUDA tensors that needs no gradient goes
straight to the op's CUDA kernel (``direct_call_ok``); every other call goes through the
dispatcher, and both give the same outputs."""

import pytest
import torch

import qmoe
from qmoe._library import direct_call_ok
from qmoe.ops.permute_mask import _permute_mask

CUDA = torch.cuda.is_available()


def _args(dev, requires_grad=False):
    x = torch.randn(33, 17, device=dev, requires_grad=requires_grad)
    ids = torch.rand(33, 6, device=dev).argsort(1)[:, :2]
    mask = torch.zeros(33, 6, dtype=torch.bool, device=dev).scatter_(1, ids, True)
    probs = torch.rand(33, 6, device=dev)
    return x, mask, probs


def test_cpu_and_subclass_calls_take_the_dispatcher():
    x, mask, probs = _args("cpu")
    assert not direct_call_ok((x, mask, probs, None, 66, 1))
    assert not direct_call_ok((3, None))  # no tensor at all
    q = qmoe.quantize(torch.randn(4, 128), qmoe.Blockwise())
    assert not direct_call_ok((q,))


@pytest.mark.skipif(not CUDA, reason="the direct call serves CUDA kernels")
def test_direct_call_only_where_the_dispatcher_would_pass_through():
    x, mask, probs = _args("cuda")
    args = (x, mask, probs, None, 66, 1)
    assert direct_call_ok(args)
    xg = x.clone().requires_grad_()
    assert not direct_call_ok((xg, mask, probs, None, 66, 1))
    with torch.no_grad():
        assert direct_call_ok((xg, mask, probs, None, 66, 1))
    assert not direct_call_ok((torch.nn.Parameter(x), mask, probs, None, 66, 1))
    with torch.device("cuda"):  # a torch function mode
        assert not direct_call_ok(args)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert not direct_call_ok(args)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert not direct_call_ok(args)
    assert not direct_call_ok((torch.randn(3), x))  # the first tensor decides the device


@pytest.mark.skipif(not CUDA, reason="the direct call serves CUDA kernels")
def test_direct_and_dispatched_calls_agree():
    x, mask, probs = _args("cuda")
    args = (x, mask, probs, None, 70, 4)
    direct = _permute_mask(*args)
    dispatched = torch.ops.qmoe.permute_mask(*args)
    for a, b in zip(direct, dispatched):
        assert torch.equal(a, b)
    # with a gradient needed the dispatcher's autograd runs: outputs carry a grad_fn
    xg = x.clone().requires_grad_()
    out = _permute_mask(xg, mask, probs, None, 70, 4)[0]
    assert out.grad_fn is not None
    out.sum().backward()
    assert xg.grad is not None


@pytest.mark.skipif(not CUDA, reason="the direct call serves CUDA kernels")
def test_profiler_sees_the_op_name():
    x, mask, probs = _args("cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        qmoe.moe_permute(x, mask, num_out_tokens=66)
    assert any("qmoe::permute_mask" in ev.name for ev in prof.events())

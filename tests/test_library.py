"""``qmoe._library``: eager calls on plain tensors skip the dispatcher's layers
(``eager_route``): with no gradient needed, straight to the op's CUDA kernel
(``direct_call_ok``) or below autograd on CPU; with one needed, the op's autograd formula
as an ``autograd.Function`` around the kernel; a quantized input with no gradient needed,
straight to its passthrough rule. Every other call goes through the dispatcher, and both
give the same outputs and gradients."""

import pytest
import torch

import qmoe
from qmoe._library import (
    DISPATCHER,
    NEEDS_GRAD,
    NO_GRAD,
    SUBCLASS,
    direct,
    direct_call_ok,
    eager_route,
)
from qmoe.ops.permute import _permute
from qmoe.ops.permute_mask import _permute_mask
from qmoe.ops.swiglu import _swiglu
from qmoe.ops.unpermute import _unpermute
from qmoe.tensors import base as base_module
from qmoe.tensors.base import QuantizedFallbackWarning, QuantizedTensor

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
    with torch.no_grad():  # a Parameter dispatches as a plain tensor
        assert direct_call_ok((torch.nn.Parameter(x), mask, probs, None, 66, 1))
    assert not direct_call_ok((torch.nn.Parameter(x), mask, probs, None, 66, 1))  # grad
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
    assert direct[2] is None and dispatched[2] is None  # no side rows
    for a, b in zip(direct[:2] + direct[3:], dispatched[:2] + dispatched[3:]):
        assert torch.equal(a, b)
    # with a gradient needed the dispatcher's autograd runs: outputs carry a grad_fn
    xg = x.clone().requires_grad_()
    out = _permute_mask(xg, mask, probs, None, 70, 4)[0]
    assert out.grad_fn is not None
    out.sum().backward()
    assert xg.grad is not None


@pytest.mark.parametrize("dev", ["cpu"] + (["cuda"] if CUDA else []))
def test_plain_calls_carry_their_backend_key_alone_below_autograd(dev, monkeypatch):
    """What ``Op.redispatch``'s CUDA shortcut relies on: a dispatched call on plain tensors
    reaches the op's Autograd kernel with keys that, below autograd, are the backend's
    alone (the dispatcher leaves out fallthrough keys such as ADInplaceOrView), with and
    without a gradient needed; a fake tensor's carry more."""
    from qmoe import _library

    seen = []
    real = _library.Op.redispatch

    def spy(self, keyset, *args):
        seen.append((keyset & _library._AFTER_AUTOGRAD).raw_repr())
        return real(self, keyset, *args)

    monkeypatch.setattr(_library.Op, "redispatch", spy)
    x, mask, probs = _args(dev)
    rid, fill = torch.ops.qmoe.make_row_id_map(mask, 70, False, 1)
    torch.ops.qmoe.permute(x, rid, probs, 70, fill)
    torch.ops.qmoe.permute(x.clone().requires_grad_(), rid, probs, 70, fill)
    backend = torch._C.DispatchKey.CUDA if dev == "cuda" else torch._C.DispatchKey.CPU
    assert len(seen) >= 2 and set(seen) == {torch._C.DispatchKeySet(backend).raw_repr()}
    if dev == "cuda":
        assert seen[0] == _library._PLAIN_CUDA
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen.clear()
    with FakeTensorMode() as mode:
        torch.ops.qmoe.permute(*(mode.from_tensor(t) for t in (x, rid, probs)), 70, None)
    assert seen and torch._C.DispatchKeySet(backend).raw_repr() not in seen


@pytest.mark.skipif(not CUDA, reason="the direct call serves CUDA kernels")
def test_dispatched_calls_reach_the_cuda_kernel_without_a_redispatch(monkeypatch):
    """Calls through ``torch.ops`` (a compiled graph's) on plain CUDA tensors go from the
    op's Autograd kernel straight to its CUDA kernel (``Op.redispatch``), with no
    gradient needed and inside the op's ``autograd.Function`` with one; fake tensors
    still redispatch (their fake kernel answers)."""
    redispatched = []
    real = torch._ops.OpOverload.redispatch

    def spy(self, keyset, *args, **kwargs):
        if self.namespace == "qmoe":
            redispatched.append(self)
        return real(self, keyset, *args, **kwargs)

    monkeypatch.setattr(torch._ops.OpOverload, "redispatch", spy)
    x, mask, probs = _args("cuda")
    rid, fill = torch.ops.qmoe.make_row_id_map(mask, 70, False, 1)
    rows, pp = torch.ops.qmoe.permute(x, rid, probs, 70, fill)
    assert torch.equal(rows, _permute(x, rid, probs, 70, fill)[0])
    xg = x.clone().requires_grad_()
    out = torch.ops.qmoe.permute(xg, rid, probs, 70, fill)[0]
    assert type(out.grad_fn).__name__ == "Function_permuteBackward"
    out.sum().backward()
    assert torch.equal(xg.grad, torch.ops.qmoe.unpermute(torch.ones_like(rows), rid, None))
    assert redispatched == []
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx, frid, fp = (mode.from_tensor(t) for t in (x, rid, probs))
        assert torch.ops.qmoe.permute(fx, frid, fp, 70, None)[0].shape == (70, x.shape[1])
    assert redispatched, "fake tensors take the dispatcher below autograd"


@pytest.mark.skipif(not CUDA, reason="the direct call serves CUDA kernels")
def test_profiler_sees_the_op_name():
    x, mask, probs = _args("cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        qmoe.moe_permute(x, mask, num_out_tokens=66)
    assert any("qmoe::permute_mask" in ev.name for ev in prof.events())


def test_eager_routes():
    x, mask, probs = _args("cpu")
    assert eager_route((x, mask, probs, None, 66, 1)) == NO_GRAD
    xg = x.clone().requires_grad_()
    assert eager_route((xg, mask, probs, None, 66, 1)) == NEEDS_GRAD
    with torch.no_grad():
        assert eager_route((xg, mask)) == NO_GRAD
    with torch.inference_mode():
        assert eager_route((x, mask)) == NO_GRAD
    assert eager_route((3, None)) == DISPATCHER  # no tensor at all
    assert eager_route((torch.nn.Parameter(x), mask)) == NEEDS_GRAD  # as a plain tensor
    with torch.no_grad():
        assert eager_route((torch.nn.Parameter(x), mask)) == NO_GRAD
    buffer = torch.nn.parameter.UninitializedBuffer()  # other subclasses: the dispatcher
    assert eager_route((buffer, mask)) == DISPATCHER
    q = qmoe.quantize(torch.randn(4, 128), qmoe.Blockwise())
    assert eager_route((q, mask)) == SUBCLASS  # qmoe's quantized tensors: their rule
    assert eager_route((q.detach().requires_grad_(), mask)) == DISPATCHER  # autograd
    with torch.no_grad():
        assert eager_route((q.detach().requires_grad_(), mask)) == SUBCLASS
    with torch.no_grad():
        assert eager_route((q, torch.nn.Parameter(x))) == SUBCLASS
    with torch.device("cpu"):  # a torch function mode
        assert eager_route((x, mask)) == DISPATCHER
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert eager_route((x, mask)) == DISPATCHER
    assert torch.func.grad(lambda t: (eager_route((t,)) == DISPATCHER) * t.sum())(
        torch.ones(2)).eq(1).all()  # a functorch transform
    assert not direct_call_ok((x, mask))  # CPU: no CUDA kernel to call


@pytest.mark.parametrize("dev", ["cpu"] + (["cuda"] if CUDA else []))
def test_direct_autograd_matches_the_dispatcher(dev):
    """The permute and the weighted merge, called through ``Op`` (the direct
    ``autograd.Function``) and through ``torch.ops`` (the dispatcher's autograd): the same
    outputs and the same gradients, bit for bit, first and second order; both record the
    op's one ``autograd.Function`` (``Op.register_autograd``), and no node without
    gradients."""
    x, mask, probs = _args(dev)
    n = int(mask.sum()) + 3
    rid, fill = torch.ops.qmoe.make_row_id_map(mask, n, False, 1)
    results = []
    for call in ((_permute, _unpermute), (torch.ops.qmoe.permute, torch.ops.qmoe.unpermute)):
        xg, pg = x.clone().requires_grad_(), probs.clone().requires_grad_()
        rows, pp = call[0](xg, rid, pg, n, fill)
        merged = call[1](rows * 2, rid, pg)
        gx, gp = torch.autograd.grad((merged.square().sum() + pp.sum()), (xg, pg),
                                     create_graph=True)
        ggx, = torch.autograd.grad((gx * gp.sum()).sum(), (xg,))
        results.append((rows, pp, merged, gx, gp, ggx, type(rows.grad_fn).__name__))
    direct, dispatched = results
    for a, b in zip(direct[:-1], dispatched[:-1]):
        assert torch.equal(a, b)
    assert direct[-1] == dispatched[-1] == "Function_permuteBackward", results
    with torch.no_grad():
        out = _permute(x, rid, probs, n, fill)[0]
    assert out.grad_fn is None and torch.equal(out, direct[0])


@pytest.mark.parametrize("dev", ["cpu"] + (["cuda"] if CUDA else []))
def test_quantized_calls_reach_their_rule_as_through_the_dispatcher(dev, monkeypatch):
    """An eager call on a quantized input with no gradient needed goes from ``Op`` straight
    to the passthrough rule (``SUBCLASS``): the same outputs as through ``torch.ops``, bit
    for bit (bits, scales, map); an op without a rule falls back through the dispatcher as
    before (its dequantizing fallback and warning); with a gradient needed the
    dispatcher's autograd records the call."""
    x, mask, probs = _args(dev)
    t = x.shape[0]
    seen = []  # the qmoe ops that reach __torch_dispatch__
    base = QuantizedTensor.__dict__["__torch_dispatch__"].__func__

    def spy(cls, func, types, args=(), kwargs=None):
        if func.namespace == "qmoe":
            seen.append(func.name())
        return base(cls, func, types, args, kwargs)

    monkeypatch.setattr(QuantizedTensor, "__torch_dispatch__", classmethod(spy))
    monkeypatch.setattr(base_module, "_BASE_DISPATCH", spy)  # (still qmoe's own dispatch)
    for recipe in (qmoe.Blockwise(), qmoe.MXFP8(), qmoe.PerTensor()):
        q = qmoe.quantize(torch.randn(t, 200, device=dev), recipe)
        args = (q, mask, probs, None, 70, 1)
        direct_out = _permute_mask(*args)
        assert seen == []  # no dispatcher on the way to the rule
        dispatched = torch.ops.qmoe.permute_mask(*args)
        assert seen == ["qmoe::permute_mask"]
        seen.clear()
        assert type(direct_out[0]) is type(q) is type(dispatched[0])
        assert torch.equal(direct_out[0].qdata.view(torch.uint8),
                           dispatched[0].qdata.view(torch.uint8))
        assert torch.equal(direct_out[0].raw_scale, dispatched[0].raw_scale)
        assert direct_out[2] is None and dispatched[2] is None  # no side rows out
        for a, b in zip(direct_out[1::2], dispatched[1::2]):  # the probs and the map
            assert torch.equal(a, b)
        rid = direct_out[3]
        merged = direct(torch.ops.qmoe.unpermute.default)(direct_out[0], rid, probs)
        assert seen == []
        assert torch.equal(merged, torch.ops.qmoe.unpermute(dispatched[0], rid, probs))
        seen.clear()
    h = qmoe.quantize(torch.randn(5, 256, device=dev), qmoe.Blockwise())
    with pytest.warns(QuantizedFallbackWarning, match="swiglu"):
        got = _swiglu(h)  # no rule: the dispatcher's fallback on the dequantized input
    assert type(got) is torch.Tensor and torch.equal(got, _swiglu(h.dequantize()))
    qg = qmoe.quantize(torch.randn(t, 128, device=dev), qmoe.Blockwise())
    qg.requires_grad_()
    out = _permute_mask(qg, mask, probs, None, 70, 1)[0]
    assert out.grad_fn is not None


def test_quantized_route_leaves_overrides_and_bad_arity_to_the_dispatcher():
    """A quantized subclass that overrides ``__torch_dispatch__`` (or defines
    ``__torch_function__``) gets its override, as through ``torch.ops``; a call with too
    many arguments gets the dispatcher's schema error, plain or quantized."""
    calls = []

    class Logged(qmoe.Float8BlockwiseTensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            calls.append(str(func))
            return super().__torch_dispatch__(func, types, args, kwargs)

    x, mask, probs = _args("cpu")
    q = qmoe.quantize(torch.randn(x.shape[0], 128), qmoe.Blockwise())
    lq = Logged(q.qdata, q.scale, q.orig_dtype, q.block_size)
    _permute_mask(lq, mask, probs, None, 70, 1)
    assert "qmoe.permute_mask.default" in calls
    rid, fill = torch.ops.qmoe.make_row_id_map(mask, 70, False, 1)
    for inp in (x, q):
        with pytest.raises(RuntimeError):
            _permute(inp, rid, None, 70, fill, 99)


def test_each_op_keeps_its_module_name():
    """Each ``define``d op is still the object its module names it by (a later function of
    the same name would shadow the ``Op``, and the module's calls would then miss its direct
    paths and autograd formula)."""
    import sys

    import qmoe.distributed  # noqa: F401 - defines qmoe::all_to_all_rows
    from qmoe._library import _OPS

    assert len(_OPS) > 20
    for op in _OPS.values():
        assert getattr(sys.modules[op.fn.__module__], op.fn.__name__, None) is op, op.name

"""Dispatch rules: op table, passthrough registry, fallback warning and strict mode."""

import warnings

import pytest
import torch

import qmoe
from qmoe.tensors.base import QuantizedDispatchError, QuantizedFallbackWarning
from tests.tensors.helpers import LAYOUTS, assert_same_bits, take_rows

SEEN = []


@torch.library.custom_op("qmoe_test::gather_rows", mutates_args=())
def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return take_rows(x, index)


@gather_rows.register_fake
def _(x, index):
    return x.new_empty((index.shape[0], *x.shape[1:]))


def _gather_passthrough(func, args, kwargs):
    x, index = args
    SEEN.append(type(x))  # the quantized tensor arrives intact
    return x.map_rows(lambda t: func(t, index))


@pytest.fixture
def registered():
    qmoe.register_passthrough(torch.ops.qmoe_test.gather_rows.default, _gather_passthrough)
    SEEN.clear()
    yield torch.ops.qmoe_test.gather_rows.default
    qmoe.unregister_passthrough(torch.ops.qmoe_test.gather_rows.default)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_passthrough_receives_quantized_intact(registered, name):
    q = qmoe.quantize(torch.randn(9, 200), LAYOUTS[name])
    idx = torch.tensor([8, 0, 0, 3])
    out = torch.ops.qmoe_test.gather_rows(q, idx)
    assert [type(q)] == SEEN
    assert type(out) is type(q)
    assert_same_bits(out.qdata, take_rows(q.qdata, idx))
    want = q.raw_scale if q.block_size is None else take_rows(q.raw_scale, idx)
    assert_same_bits(out.raw_scale, want)
    assert registered in qmoe.passthrough_ops()


def test_unregistered_custom_op_falls_back(recwarn):
    q = qmoe.quantize(torch.randn(9, 200), qmoe.Blockwise())
    with pytest.warns(QuantizedFallbackWarning, match="qmoe_test.gather_rows"):
        out = torch.ops.qmoe_test.gather_rows(q, torch.tensor([1]))
    assert type(out) is torch.Tensor and torch.equal(out, q.dequantize()[1:2])


def test_registry_errors(registered):
    with pytest.raises(ValueError, match="already has a passthrough"):
        qmoe.register_passthrough(registered, lambda f, a, k: None)
    qmoe.register_passthrough(registered, _gather_passthrough)  # same impl: no error
    with pytest.raises(TypeError, match="OpOverload"):
        qmoe.register_passthrough(lambda x: x, _gather_passthrough)
    with pytest.raises(ValueError, match="one of qmoe's own ops"):
        qmoe.unregister_passthrough(torch.ops.qmoe.permute)
    assert torch.ops.qmoe.permute.default in qmoe.passthrough_ops()
    # A packet registers its default overload.
    qmoe.unregister_passthrough(torch.ops.qmoe_test.gather_rows)
    assert registered not in qmoe.passthrough_ops()


def test_fallback_warns_once_per_op_and_names_it():
    q = qmoe.quantize(torch.randn(4, 64), qmoe.MXFP8())
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("default")
        for _ in range(3):
            out = q * 2
        q.t()
    msgs = [str(x.message) for x in w if issubclass(x.category, QuantizedFallbackWarning)]
    assert len(msgs) == 2, msgs
    assert "aten.mul.Tensor" in msgs[0] and "aten.t.default" in msgs[1]
    assert type(out) is torch.Tensor and torch.equal(out, q.dequantize() * 2)


def test_strict_mode_raises_and_is_scoped():
    q = qmoe.quantize(torch.randn(4, 64), qmoe.PerTensor())
    with qmoe.strict_dispatch():
        with pytest.raises(QuantizedDispatchError, match="aten.add.Tensor"):
            q + 1
        q[1:3]  # table ops still work
        with qmoe.strict_dispatch(False), pytest.warns(QuantizedFallbackWarning):
            q + 1
        with pytest.raises(NotImplementedError):
            q.sum()
    with pytest.warns(QuantizedFallbackWarning):
        q + 1


def test_repr_does_not_dequantize():
    q = qmoe.quantize(torch.randn(4, 64), qmoe.Blockwise())
    with qmoe.strict_dispatch():
        r = repr(q)
    assert "Float8BlockwiseTensor" in r and "block_size=128" in r


def test_fallback_gradient_reaches_input():
    x = torch.randn(4, 64, requires_grad=True)
    q = qmoe.quantize(x, qmoe.Blockwise())
    with pytest.warns(QuantizedFallbackWarning):
        (q * 3).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))


def test_op_tables_resolve_nearest_class_first_and_see_later_rules():
    """A subclass's own rule wins over its base's, and a rule added to a base after the
    subclass exists still reaches the subclass (the lookup walks each class's table)."""
    from qmoe.tensors.base import QuantizedTensor

    class Sub(qmoe.Float8BlockwiseTensor):
        pass

    op, other = torch.ops.aten.sgn.default, torch.ops.aten.sign.default
    base_rule, sub_rule = (lambda *a: "base"), (lambda *a: "sub")
    assert Sub._lookup(op) is None
    try:
        QuantizedTensor._op_table[op] = base_rule  # registered after Sub was made
        QuantizedTensor._op_table[other] = base_rule
        assert Sub._lookup(op) is base_rule
        Sub.implements(op)(sub_rule)
        assert Sub._lookup(op) is sub_rule and Sub._lookup(other) is base_rule
        assert qmoe.Float8BlockwiseTensor._lookup(op) is base_rule
    finally:
        QuantizedTensor._op_table.pop(op, None)
        QuantizedTensor._op_table.pop(other, None)
    assert Sub._lookup(other) is None

"""torch.compile(fullgraph=True): subclasses as inputs and outputs, row ops, quantize.

Each graph costs ~15 s on 2 CPU cores, so one graph per layout covers the row ops,
one covers quantize + autograd, and one the passthrough registry.
"""

import pytest
import torch

import qmoe
from tests.tensors.helpers import (
    LAYOUTS,
    RECIPES,
    assert_same_bits,
    assert_same_quantized,
    take_rows,
)

pytestmark = pytest.mark.compile


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    # Inductor otherwise fuses away the bf16 rounding of dequantize(); with it emulated,
    # compiled and eager results must agree bit for bit.
    with torch._inductor.config.patch(emulate_precision_casts=True):
        yield


def _row_ops(q, idx):
    a = q[2:6]
    b = q.index_select(0, idx)
    c = q[idx[:2]]
    d = torch.cat([a, b, c]).view(2, -1, q.shape[-1])
    e, f = d[1].split([3, 2])
    return d, e.detach().clone(), f, q.dequantize()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_row_ops_compile(name, device):
    q = qmoe.quantize(torch.randn(9, 300, dtype=torch.bfloat16, device=device), LAYOUTS[name])
    idx = torch.tensor([8, 0, 3, 3], device=device)
    got = torch.compile(_row_ops, fullgraph=True)(q, idx)
    want = _row_ops(q, idx)
    for g, w in zip(got[:3], want[:3]):
        assert_same_quantized(g, w)
    assert torch.equal(got[3], want[3])


@pytest.mark.parametrize("name", [*LAYOUTS, "mx-rceil-e4m3"])
def test_quantize_and_backward_compile(name, device):
    recipe = RECIPES[name]

    def f(x):
        q = qmoe.quantize(x, recipe)
        # q leaves the graph detached: a quantized output that needs grad would get a
        # quantized tangent guess from AOTAutograd (see docs/tensors.md).
        return q.detach(), q[1:5].dequantize(torch.float32).square().sum()

    x = torch.randn(8, 256, dtype=torch.bfloat16, device=device, requires_grad=True)
    q, loss = torch.compile(f, fullgraph=True)(x)
    loss.backward()
    qe, le = f(x.detach().requires_grad_())
    assert_same_quantized(q, qe)
    torch.testing.assert_close(loss, le, rtol=1e-5, atol=0)  # fp32 sums: order may differ
    want = torch.zeros_like(x)
    want[1:5] = (2 * qe[1:5].dequantize(torch.float32)).to(x.dtype)
    assert torch.equal(x.grad, want)


def test_passthrough_op_compiles(device):
    from tests.tensors.test_dispatch import _gather_passthrough

    op = torch.ops.qmoe_test.gather_rows.default
    qmoe.register_passthrough(op, _gather_passthrough)
    try:
        q = qmoe.quantize(torch.randn(9, 200, device=device), qmoe.MXFP8())
        idx = torch.tensor([8, 0, 0, 3], device=device)
        out = torch.compile(lambda q, i: torch.ops.qmoe_test.gather_rows(q, i), fullgraph=True)(
            q, idx
        )
        assert type(out) is qmoe.MXFP8Tensor
        assert_same_bits(out.qdata, take_rows(q.qdata, idx))
        assert_same_bits(out.raw_scale, take_rows(q.raw_scale, idx))
    finally:
        qmoe.unregister_passthrough(op)

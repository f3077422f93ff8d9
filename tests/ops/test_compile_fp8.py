"""torch.compile(fullgraph=True) with quantized inputs: no graph break, the quantized type
out, bit-identical to eager (one graph per layout, to keep CI short)."""

import pytest
import torch

import qmoe
from tests.ops.helpers import routing
from tests.tensors.helpers import LAYOUTS, assert_same_quantized

pytestmark = pytest.mark.compile
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    with torch._inductor.config.patch(emulate_precision_casts=True):
        yield


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_quantized_moe_block_compiles(name):
    t, h, e, k = 40, 160, 8, 2
    ids, mask = routing(t, e, k, "sentinels", DEV)
    recipe = LAYOUTS[name]
    sizes = torch.tensor([10, 0, 30], device=DEV)
    order = torch.tensor([2, 0, 1], device=DEV)

    def f(x, probs, w):
        q = qmoe.quantize(x, recipe)
        qs = qmoe.moe_sort_chunks_by_index(q, sizes, order)
        out, pp, rid = qmoe.moe_permute_with_probs(qs, probs, mask, t * k)
        y = qmoe.moe_unpermute(out.dequantize(torch.float32) * pp[:, None], rid, w)
        return out.detach(), y

    def run(fn):
        x = torch.randn(t, h, device=DEV).requires_grad_()
        probs = torch.rand(t, e, device=DEV)
        w = torch.rand(t, e, device=DEV)
        torch.manual_seed(0)
        out, y = fn(x, probs, w)
        y.square().sum().backward()
        return out, y, x.grad

    torch.manual_seed(1)
    got = run(torch.compile(f, fullgraph=True))
    torch.manual_seed(1)
    want = run(f)
    assert_same_quantized(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-5)


def test_quantized_input_and_output_of_compiled_permute():
    t, h, e, k = 33, 256, 4, 2
    ids, mask = routing(t, e, k, "random", DEV)
    q = qmoe.quantize(torch.randn(t, h, device=DEV), qmoe.MXFP8())

    def f(q, ids):
        return qmoe.moe_permute(q, ids, t * k, map_type="index")

    got, rid = torch.compile(f, fullgraph=True)(q, ids)
    want, rid_e = f(q, ids)
    assert_same_quantized(got, want)
    assert torch.equal(rid, rid_e)

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
    """quantize -> chunk sort -> permute with probs (mask map) and permute (index map) ->
    merges of dequantized rows and of the quantized rows themselves -> the sync-free pad
    form -> backward: every output and the gradient bit-identical to eager."""
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
        out_i, rid_i = qmoe.moe_permute(qs, ids, t * k - 3, map_type="index")
        y_q = qmoe.moe_unpermute(out_i, rid_i, w[:, :k], map_type="index")  # FP8 merge
        padded = qmoe.moe_permute_and_pad_with_probs(q.detach(), probs, mask, None, 16,
                                                     num_out_tokens=t * k + e * 16)
        return out.detach(), y, out_i.detach(), y_q, padded[0], padded[1]

    def run(fn, seed):
        torch.manual_seed(seed)
        x = torch.randn(t, h, device=DEV).requires_grad_()
        probs = torch.rand(t, e, device=DEV)
        w = torch.rand(t, e, device=DEV)
        outs = fn(x, probs, w)
        (outs[1].square().sum() + outs[3].sum()).backward()
        return (*outs, x.grad)

    seed = int(torch.randint(2**31, ()))
    got = run(torch.compile(f, fullgraph=True), seed)
    want = run(f, seed)
    for i in (0, 2, 4):
        assert_same_quantized(got[i], want[i])
    for i in (1, 3, 5, 6):
        assert torch.equal(got[i], want[i]), i


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

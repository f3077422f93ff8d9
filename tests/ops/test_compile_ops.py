"""torch.compile(fullgraph=True): permute -> expert work -> unpermute, forward and backward,
both map types and the chunk sort; dynamic=True over T compiles once."""

import pytest
import torch

import qmoe
from tests.ops.helpers import routing

pytestmark = pytest.mark.compile
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield


def _moe(x, rm, probs, w, map_type, n):
    out, pp, rid = qmoe.moe_permute_with_probs(x, probs, rm, n, map_type=map_type)
    y = torch.tanh(out) * pp[:, None].to(out.dtype)
    return qmoe.moe_unpermute(y, rid, w, map_type=map_type)


@pytest.mark.parametrize("map_type", ["mask", "index"])
def test_moe_block_compiles_fwd_bwd(map_type):
    t, h, e, k = 48, 32, 8, 2
    ids, mask = routing(t, e, k, "sentinels", DEV)
    rm = mask if map_type == "mask" else ids
    cols = rm.shape[1]

    def run(fn):
        torch.manual_seed(0)
        x = torch.randn(t, h, device=DEV, requires_grad=True)
        probs = torch.rand(t, cols, device=DEV, requires_grad=True)
        w = torch.rand(t, cols, device=DEV, requires_grad=True)
        y = fn(x, rm, probs, w, map_type, t * k)
        y.square().sum().backward()
        return y, x.grad, probs.grad, w.grad

    got = run(torch.compile(_moe, fullgraph=True))
    want = run(_moe)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_sort_chunks_and_pad_compile():
    t, h, e = 40, 16, 4
    ids, mask = routing(t, e, 2, "random", DEV)
    sizes = torch.tensor([10, 5, 0, 25], device=DEV)
    order = torch.tensor([3, 1, 0, 2], device=DEV)

    def f(x, probs):
        y = qmoe.moe_sort_chunks_by_index(x, sizes, order)
        out, pp, rid, po, tgt = qmoe.moe_permute_and_pad_with_probs(
            y, probs, mask, None, 8, num_out_tokens=t * 2 + e * 8
        )
        return out, pp, tgt

    x = torch.randn(t, h, device=DEV)
    probs = torch.rand(t, e, device=DEV)
    got = torch.compile(f, fullgraph=True)(x, probs)
    want = f(x, probs)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_dynamic_tokens_compile_once():
    from torch._dynamo.testing import CompileCounter

    cnt = CompileCounter()
    e, k, h = 8, 2, 16

    def f(x, ids):
        out, rid = qmoe.moe_permute(x, ids, x.shape[0] * k, map_type="index")
        return qmoe.moe_unpermute(out * 2, rid, map_type="index")

    cf = torch.compile(f, fullgraph=True, dynamic=True, backend=cnt)
    for t in (5, 17, 64, 33):
        ids, _ = routing(t, e, k, "random", DEV)
        x = torch.randn(t, h, device=DEV)
        assert torch.equal(cf(x, ids), f(x, ids))
    assert cnt.frame_count == 1

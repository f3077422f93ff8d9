"""torch.compile(fullgraph=True): permute -> expert work -> unpermute, forward and backward,
both map types and the chunk sort; dynamic=True over T compiles once."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qmoe
from tests.ops.helpers import routing

pytestmark = pytest.mark.compile
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    # bit-exact compiled vs eager: no fused multiply-adds that eager rounds in two steps
    with torch._inductor.config.patch(emulate_precision_casts=True):
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

    seed = int(torch.randint(2**31, ()))  # fresh each run, the same for both calls

    def run(fn):
        torch.manual_seed(seed)
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
        y, py = qmoe.moe_sort_chunks_by_index_with_probs(x, probs[:, 0], sizes, order)
        out, pp, rid, po, tgt = qmoe.moe_permute_and_pad_with_probs(
            y, probs, mask, None, 8, num_out_tokens=t * 2 + e * 8
        )
        return out, pp, tgt, py

    def run(fn, x0, p0):
        x, probs = x0.clone().requires_grad_(), p0.clone().requires_grad_()
        outs = fn(x, probs)
        (outs[0].square().sum() + (outs[1] * outs[1]).sum() + outs[3].sum()).backward()
        return (*outs, x.grad, probs.grad)

    x = torch.randn(t, h, device=DEV)
    probs = torch.rand(t, e, device=DEV)
    got = run(torch.compile(f, fullgraph=True), x, probs)
    want = run(f, x, probs)
    for g, w in zip(got, want):  # forward and backward, bit for bit
        assert torch.equal(g, w)


@pytest.mark.parametrize("map_type", ["index", "mask"])
def test_dynamic_tokens_compile_once(map_type):
    """dynamic=True over T: one compile for four token counts; the mask form also carries
    probs, merging probs and a backward (through AOTAutograd: aot_eager runs its forward
    and backward graphs, bit for bit with eager)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    cnt = CompileCounterWithBackend("aot_eager")
    e, k, h = 8, 2, 16

    def f_index(x, ids):
        out, rid = qmoe.moe_permute(x, ids, x.shape[0] * k, map_type="index")
        return qmoe.moe_unpermute(out * 2, rid, map_type="index")

    def f_mask(x, mask, probs):
        out, pp, rid = qmoe.moe_permute_with_probs(x, probs, mask, x.shape[0] * k)
        return qmoe.moe_unpermute(out * pp[:, None], rid, probs)

    f = f_index if map_type == "index" else f_mask
    cf = torch.compile(f, fullgraph=True, dynamic=True, backend=cnt)
    for t in (5, 17, 64, 33):
        ids, mask = routing(t, e, k, "random", DEV)
        x = torch.randn(t, h, device=DEV)
        if map_type == "index":
            assert torch.equal(cf(x, ids), f(x, ids))
            continue
        probs = torch.rand(t, e, device=DEV)
        grads = []
        for fn in (cf, f):
            xr, pr = x.clone().requires_grad_(), probs.clone().requires_grad_()
            y = fn(xr, mask, pr)
            y.square().sum().backward()
            grads.append((y, xr.grad, pr.grad))
        for a, b in zip(*grads):
            assert torch.equal(a, b)
    assert cnt.frame_count == 1


def test_changing_token_counts_compile_once_with_mark_dynamic():
    """docs/ops.md's advice for a layer whose T changes: ``torch._dynamo.mark_dynamic`` on
    the inputs' token dim (or ``dynamic=True``, test_dynamic_tokens_compile_once) before
    the first call; then T = 64, 96, 128 cost one compile, forward and backward, bit for
    bit with eager. Without it torch compiles once more when T first changes."""
    from torch._dynamo.testing import CompileCounterWithBackend

    e, k, h = 8, 2, 16

    def f(x, mask, probs):
        out, pp, rid = qmoe.moe_permute_with_probs(x, probs, mask, x.shape[0] * k)
        return qmoe.moe_unpermute(out * pp[:, None], rid, probs)

    for advice, compiles in ((True, 1), (False, 2)):
        torch._dynamo.reset()
        cnt = CompileCounterWithBackend("aot_eager")
        cf = torch.compile(f, fullgraph=True, backend=cnt)
        for t in (64, 96, 128):
            _, mask = routing(t, e, k, "random", DEV)
            x, probs = torch.randn(t, h, device=DEV), torch.rand(t, e, device=DEV)
            outs = []
            for fn in (cf, f):
                xr, pr = x.clone().requires_grad_(), probs.clone().requires_grad_()
                if advice:
                    for a in (xr, mask, pr):
                        torch._dynamo.mark_dynamic(a, 0)
                y = fn(xr, mask, pr)
                y.square().sum().backward()
                outs.append((y, xr.grad, pr.grad))
            for a, b in zip(*outs):
                assert torch.equal(a, b)
        assert cnt.frame_count == compiles, (advice, cnt.frame_count)


def test_tensor_num_out_tokens_with_captured_scalars():
    """TransformerEngine's callers pass ``tokens_per_expert.sum()``: with
    ``capture_scalar_outputs`` it becomes a data-dependent size and the call stays in one
    graph (no branch on it)."""
    t, h, e, k = 24, 16, 6, 2
    _, mask = routing(t, e, k, "no_route_tokens", DEV)

    def f(x, mask, probs):
        out, pp, rid = qmoe.moe_permute_with_probs(x, probs, mask, mask.sum())
        padded = qmoe.moe_permute_and_pad_with_probs(x, probs, mask, None, 8,
                                                     num_out_tokens=mask.sum() + 6 * 8)
        return out, qmoe.moe_unpermute(out * pp[:, None], rid, probs), padded[0]

    x, probs = torch.randn(t, h, device=DEV), torch.rand(t, e, device=DEV)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        got = torch.compile(f, fullgraph=True)(x, mask, probs)
    want = f(x, mask, probs)
    assert got[0].shape[0] == int(mask.sum())
    for a, b in zip(got, want):
        assert torch.equal(a, b)


_BAD_IDS_CHILD = """
import sys, torch, qmoe
ids = torch.tensor([[0, 1], [2, 6]], device="cuda")
x = torch.randn(2, 128, device="cuda")
f = lambda x: qmoe.moe_permute(x, ids, 4, map_type="index", num_experts=4)[0]
torch.compile(f, fullgraph=sys.argv[1] == "True")(x)
torch.cuda.synchronize()
print("no error")
"""


@pytest.mark.parametrize("fullgraph", [True, False])
def test_bad_input_under_compile(fullgraph):
    """Bad input under torch.compile raises with qmoe's message: the checks in the public
    functions as Dynamo's error whose first line is qmoe's message, chained to
    qmoe's ValueError/TypeError, with or without fullgraph (``user_errors``); a refusal
    of the subclass dispatch (mixed recipes) as Dynamo's TorchRuntimeError quoting it;
    value checks on data when the graph runs."""
    t, h, e = 8, 128, 4
    ids, mask = routing(t, e, 2, "random", DEV)
    x = torch.randn(t, h, device=DEV)
    qb = qmoe.quantize(x, qmoe.Blockwise())
    qm = qmoe.quantize(x, qmoe.MXFP8())
    qp = qmoe.quantize(torch.rand(t, e, device=DEV), qmoe.PerTensor())  # probs' shape
    cases = [  # (call, message, raised by the public function's own Python checks)
        (lambda x: qmoe.moe_permute(x, mask)[0], "pass num_out_tokens", True),
        (lambda x: qmoe.moe_permute_with_probs(x, qp, mask, 16)[0],
         "only inp may be quantized", True),
        (lambda x: qmoe.moe_permute(torch.cat([qb, qm]), torch.cat([mask, mask]), 32)[0],
         "one recipe", False),
        (lambda x: qmoe.moe_permute(x, ids + 3, 16, map_type="index", num_experts=e)[0],
         "num_experts=4", False),
    ]
    if DEV == "cuda":  # the data check is a device assert, which ends the CUDA context
        _, msg, _ = cases.pop()
        r = subprocess.run([sys.executable, "-c", _BAD_IDS_CHILD, str(fullgraph)],
                           capture_output=True, text=True, timeout=300,
                           cwd=Path(__file__).parents[2])
        assert r.returncode != 0 and "no error" not in r.stdout, r.stderr[-2000:]
        assert msg in r.stdout + r.stderr, r.stderr[-4000:]
    for fn, msg, python_check in cases:
        torch._dynamo.reset()
        with pytest.raises(Exception) as info:
            torch.compile(fn, fullgraph=fullgraph)(x)
        assert msg in str(info.value), (msg, str(info.value)[:400])
        if python_check:  # qmoe's message is the first line the user reads
            assert msg in str(info.value).splitlines()[0], str(info.value)[:400]
        if python_check:  # qmoe's own exception, as Dynamo's error or chained to it
            assert isinstance(info.value, (ValueError, TypeError)) or isinstance(
                info.value.__context__, (ValueError, TypeError)), type(info.value)

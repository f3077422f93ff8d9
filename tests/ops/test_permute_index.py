"""``qmoe::permute_index``: the index-map permute that builds its map rows in the scatter
launch (the public ops' path for CUDA index maps with ``num_experts``).

Its kernels (CUDA, or CPU under TRITON_INTERPRET=1) against ``make_row_id_map(ids, N,
True, 1)`` (the sorting path) then the torch permute, bit for bit, into poisoned outputs;
the op's opcheck, fake, autograd and FP8 passthrough rule.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import qmoe
from qmoe.ops.kernels.permute_index import permute_index_triton
from qmoe.ops.tuning import PermuteIndexTiling
from tests.ops.helpers import map_then_permute, routing
from tests.tensors.helpers import RECIPES, assert_same_bits, assert_same_quantized

ops = torch.ops.qmoe
DEV = "cpu"  # the op's CPU path (its CUDA path is the kernel above)

CASES = [  # (T, H, E, K, kind)
    (1, 1, 4, 2, "random"), (63, 17, 7, 3, "sentinels"), (64, 300, 8, 8, "random"),
    (40, 64, 256, 8, "no_route_tokens"), (20, 33, 16, 1, "one_expert"),
    (30, 16, 8, 2, "empty_experts"), (70, 8, 1024, 4, "random"), (5, 8, 1, 1, "random"),
    (3, 7168, 8, 3, "sentinels"),
]


def _want(x, ids, n, probs, side):
    return map_then_permute(x, ids, n, True, 1, probs, side)


@pytest.mark.parametrize("t,h,e,k,kind", CASES)
def test_kernel_matches_sorting_path(kdevice, poisoned_empty, t, h, e, k, kind):
    """Rows, map, probs and side rows equal the sorting path with N at, below and above
    the routed count, over several count blocks (blocks of 16, 4 and 1 tokens), int64 and
    int32 ids, strided inputs; every output the launcher allocates starts poisoned."""
    ids, _ = routing(t, e, k, kind, kdevice)
    routed = int((ids >= 0).sum())
    x = torch.randn(t, h + 3, device=kdevice)[:, :h]  # a row stride past H
    probs = torch.rand(t, k, device=kdevice)
    side = torch.randn(t, 5, device=kdevice)
    inputs = ((ids, None, None, 16), (ids.to(torch.int32), probs, side, 4),
              (ids, probs.double(), side.view(torch.uint8)[:, :7], 1))  # fp64 probs
    for (i_, p, sd, bt), n in zip(inputs, (routed, routed // 2, routed + 70)):
        out = torch.full((n, h), float("nan"), device=kdevice)
        got = permute_index_triton(x, i_, n, e, p, sd, PermuteIndexTiling(block_t=bt), out=out)
        for g, w in zip(got, _want(x, ids, n, p, sd)):
            assert (g is None) == (w is None)  # None: not given
            if w is not None:
                assert_same_bits(g.cpu(), w)


def test_kernel_repeated_experts_in_a_token(kdevice):
    """Two slots of a token naming one expert get consecutive rows in slot order, as the
    sorting path's stable sort gives them."""
    ids = torch.tensor([[2, 2, 0], [1, -1, 2], [2, 0, 2]], device=kdevice)
    x = torch.randn(3, 6, device=kdevice)
    probs = torch.rand(3, 3, device=kdevice)
    n = int((ids >= 0).sum())
    got = permute_index_triton(x, ids, n, 3, probs, tiling=PermuteIndexTiling(block_t=2))
    for g, w in zip(got, _want(x, ids, n, probs, None)):
        assert (g is None) == (w is None)  # None: not given
        if w is not None:
            assert_same_bits(g.cpu(), w)


@pytest.mark.parametrize("dtype,e", [(torch.int8, 120), (torch.int16, 200)])
def test_kernel_narrow_id_dtypes(kdevice, dtype, e):
    """int8 / int16 ids (a uint8 map reaches the kernel as int16) give the int64 result."""
    ids, _ = routing(45, e, 4, "sentinels", kdevice)
    x = torch.randn(45, 24, device=kdevice)
    n = int((ids >= 0).sum()) - 3
    got = permute_index_triton(x, ids.to(dtype), n, e, tiling=PermuteIndexTiling(block_t=4))
    for g, w in zip(got, _want(x, ids, n, None, None)):
        assert (g is None) == (w is None)  # None: not given
        if w is not None:
            assert_same_bits(g.cpu(), w)


def test_kernel_fp8_bits_and_no_routes(kdevice):
    t, h, e = 33, 48, 8
    ids, _ = routing(t, e, 3, "sentinels", kdevice)
    bits = torch.randint(0, 256, (t, h), dtype=torch.uint8, device=kdevice)
    got = permute_index_triton(bits, ids, 80, e)
    want = _want(bits, ids, 80, None, None)
    assert_same_bits(got[0].cpu(), want[0])
    assert torch.equal(got[3].cpu(), want[3])
    # no slots: every row zero, every map row empty
    out, pp, so, rid = permute_index_triton(bits, ids[:, :0], 5, e)
    assert not out.any() and rid.shape == (t, 1) and not rid.any()
    with pytest.raises(ValueError, match="num_experts"):
        permute_index_triton(bits, ids, 80, 0)


def test_kernel_asserts_ids_below_num_experts(kdevice, interpreter_asserts):
    """An id outside [-1, num_experts) (int64 ids past 2**32 included) trips the kernel's
    device assert rather than being dropped, narrowed or written out of bounds (under the
    interpreter it raises; on CUDA a device assert ends the context, so that case is left
    to the public ops' checks, tested elsewhere); the op's CPU path raises a ValueError."""
    if kdevice != "cpu":
        pytest.skip("a device assert ends the CUDA context")
    from triton.runtime.errors import InterpreterError

    ids = torch.tensor([[0, 1], [3, -1]])
    x = torch.randn(2, 4)
    permute_index_triton(x, ids, 3, 4)  # fine as given
    for bad, e in ((ids, 3), (ids.masked_fill(ids == 3, 2**32), 4),  # not narrowed to 0
                   (ids.masked_fill(ids == -1, -2), 4)):
        with pytest.raises(InterpreterError, match=r"ids must be in \[-1, num_experts\)"):
            permute_index_triton(x, bad, 3, e)
    with pytest.raises(ValueError, match="routing_map ids must be in"):  # the op, on CPU
        ops.permute_index(x, ids, None, None, 3, 3)


@pytest.mark.parametrize("pdl", [False, True], ids=["stream_order", "pdl"])
def test_kernel_programmatic_dependent_launch(pdl):
    """Hopper: the scan and the fused kernel as programmatic dependents, at a size with
    many count blocks and waves of programs, replayed from a CUDA graph on new ids."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs a CUDA device of capability >= 9")
    t, h, e, k = 4096, 384, 256, 8
    ids = routing(t, e, k, "sentinels", "cuda")[0]
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    n = t * k - 5
    run = lambda: permute_index_triton(x, ids, n, e, tiling=PermuteIndexTiling(pdl=pdl))
    run()  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = run()
    ids.copy_(routing(t, e, k, "sentinels", "cuda")[0])
    g.replay()
    torch.cuda.synchronize()
    want = _want(x, ids, n, None, None)
    assert_same_bits(got[0].cpu(), want[0])
    assert torch.equal(got[3].cpu(), want[3])


def test_op_cpu_id_check_in_int64():
    """The op's CPU check of the ids compares in int64: an int16 map with E = 40000 (past
    int16) is valid, and an id >= E still raises."""
    t, e, k = 20, 6, 2
    ids, _ = routing(t, e, k, "sentinels", DEV)
    ids[0, 0] = e - 1  # an id >= 4 occurs (the last call must raise)
    x = torch.randn(t, 5)
    n = int((ids >= 0).sum())
    want = ops.permute_index(x, ids, None, None, n, e)
    got = ops.permute_index(x, ids.to(torch.int16), None, None, n, 40000)
    assert got[1] is None and got[2] is None and want[1] is None and want[2] is None
    for g, w in zip(got[::3], want[::3]):
        assert_same_bits(g, w)
    with pytest.raises(ValueError, match="num_experts=4"):
        ops.permute_index(x, ids.to(torch.int16), None, None, n, 4)


@pytest.mark.parametrize("t", [0, 1, 37])
def test_op_opcheck_and_fake(t):
    """``qmoe::permute_index`` passes opcheck (schema, fake, autograd registration), empty
    input included, and its fake matches the real outputs exactly."""
    e, k, h = 8, 3, 20
    ids, _ = routing(t, e, k, "sentinels", DEV)
    x = torch.randn(t, h, device=DEV, requires_grad=True)
    probs = torch.rand(t, k, device=DEV, requires_grad=True)
    side = torch.randn(t, 3, device=DEV)
    n = int((ids >= 0).sum())
    for args in ((x, ids, None, None, n, e), (x, ids.to(torch.int32), probs, side, n + 5, e),
                 (x, ids, probs, None, max(n - 2, 0), e)):
        torch.library.opcheck(ops.permute_index.default, args)
        real = ops.permute_index(*args)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = ops.permute_index(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                       for a in args])
        # probs and side rows out exactly when given (None otherwise)
        assert [r is None for r in real] == [f is None for f in fake] == [
            False, args[2] is None, args[3] is None, False]
        for r, f in zip(real, fake):
            if r is not None:
                assert (r.shape, r.dtype, r.device) == (f.shape, f.dtype, f.device)


@pytest.mark.compile
def test_op_compiles_once_over_num_experts():
    """``num_experts`` is a SymInt of the schema: under ``dynamic=True`` a new E reuses the
    graph (an ``int`` argument would specialize it, one graph per E)."""
    from torch._dynamo.testing import CompileCounter

    cnt = CompileCounter()
    f = torch.compile(lambda x, ids, n, e: ops.permute_index(x, ids, None, None, n, e)[0],
                      backend=cnt, dynamic=True, fullgraph=True)
    for e in (8, 9, 10):
        ids, _ = routing(30, e, 2, "sentinels", DEV)
        x = torch.randn(30, 16, device=DEV)
        n = int((ids >= 0).sum())
        assert_same_bits(f(x, ids, n, e), _want(x, ids, n, None, None)[0])
    assert cnt.frame_count == 1


def test_op_autograd_reaches_inp_and_probs():
    t, h, e = 21, 9, 6
    ids, _ = routing(t, e, 2, "no_route_tokens", DEV)
    x = torch.randn(t, h, dtype=torch.float64, device=DEV, requires_grad=True)
    probs = torch.rand(t, 2, dtype=torch.float64, device=DEV, requires_grad=True)
    n = int((ids >= 0).sum()) - 2  # two routes dropped: their gradient is zero

    def f(x, probs):
        out, pp, _, _ = ops.permute_index(x, ids, probs, None, n, e)
        return out, pp

    assert torch.autograd.gradcheck(f, (x, probs))


@pytest.mark.parametrize("name", ["pertensor-e4m3", "blockwise-e5m2", "mx-e4m3"])
def test_op_quantized_inp_passes_intact(name):
    """The passthrough rule moves the fp8 bits and the block-scale rows in one call; the
    result equals the public index-map permute of the quantized input."""
    t, h, e = 37, 256, 8
    ids, _ = routing(t, e, 2, "sentinels")
    q = qmoe.quantize(torch.randn(t, h), RECIPES[name])
    probs = torch.rand(t, 2)
    n = int((ids >= 0).sum()) - 3
    got, pp, so, rid = ops.permute_index(q, ids, probs, None, n, e)
    assert type(got) is type(q) and so is None  # (the scale rows travel inside got)
    want, pp_w, rid_w = qmoe.moe_permute_with_probs(q, probs, ids, n, map_type="index")
    assert_same_quantized(got, want)
    assert torch.equal(pp, pp_w) and torch.equal(rid, rid_w)
    with pytest.raises(TypeError, match="qmoe::permute_index: side rows"):
        ops.permute_index(q, ids, probs, torch.zeros(t, 2), n, e)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="the public ops take qmoe::permute_index on CUDA only")
@pytest.mark.parametrize("e", [8, 256, 512])  # fused, fused, the op's sorting path
@pytest.mark.parametrize("name", [None, "blockwise-e4m3", "mx-e5m2"])
def test_public_index_permute_with_num_experts(e, name):
    """``num_experts`` routes a CUDA index map through ``qmoe::permute_index`` (the op picks
    the fused kernel or the sorting path, ``fused_index_wins``): rows, probs, map, the merge
    and the gradients equal the call without it (the sorting path), bit for bit, with
    dropped routes and sentinels, plain and quantized."""
    t, h, k = 2100, 160, 4  # T * K past the one-launch map kernel's entries
    ids, _ = routing(t, e, k, "sentinels", "cuda")
    n = int((ids >= 0).sum()) - 9
    x0 = torch.randn(t, h, device="cuda")
    p0 = torch.rand(t, k, device="cuda")
    results = []
    for ne in (None, e):
        x, probs = x0.clone().requires_grad_(), p0.clone().requires_grad_()
        inp = x if name is None else qmoe.quantize(x, RECIPES[name])
        out, pp, rid = qmoe.moe_permute_with_probs(inp, probs, ids, n, map_type="index",
                                                   num_experts=ne)
        rows = out if name is None else out.dequantize()
        y = qmoe.moe_unpermute(rows * pp[:, None], rid, p0, map_type="index")
        y.square().sum().backward()
        results.append((out, pp, rid, y, x.grad, probs.grad))
    for a, b in zip(*results):
        if isinstance(a, qmoe.QuantizedTensor):
            assert_same_quantized(a, b)
        else:
            assert torch.equal(a, b)

"""``qmoe::permute_mask``: the mask permute that builds its map rows in the scatter launch.

Its kernel (CUDA, or CPU under TRITON_INTERPRET=1) against ``make_row_id_map`` then the
torch permute, bit for bit, into poisoned outputs; the op's FP8 passthrough rule; and the
op's autograd. The public functions take this op on CUDA (their tests then cover it too).
"""

import pytest
import torch

import qmoe
from qmoe._intmath import next_pow2
from qmoe.ops.kernels.permute_mask import permute_mask_triton
from qmoe.ops.tuning import SMALL_MAP_BYTES, FusedMaskTiling
from tests.ops.helpers import map_then_permute, routing
from tests.tensors.helpers import RECIPES, assert_same_bits, assert_same_quantized

ops = torch.ops.qmoe

CASES = [  # (T, H, E, K, kind)
    (1, 1, 4, 2, "random"), (63, 17, 7, 3, "sentinels"), (64, 300, 8, 8, "random"),
    (40, 64, 256, 8, "no_route_tokens"), (20, 33, 16, 1, "one_expert"),
    (30, 16, 8, 2, "empty_experts"), (0, 8, 4, 2, "random"), (70, 8, 1024, 4, "random"),
    (3, 7168, 8, 3, "sentinels"),
]


def _want(x, mask, n, align, probs, side):
    return map_then_permute(x, mask, n, False, align, probs, side)


@pytest.mark.parametrize("t,h,e,k,kind", CASES)
@pytest.mark.parametrize("align", [1, 16])
@pytest.mark.parametrize("one_launch", [False, True], ids=["counts_scan", "one_launch"])
def test_kernel_matches_two_step_path(kdevice, poisoned_empty, t, h, e, k, kind, align,
                                      one_launch):
    """Every token program builds its own map row: rows, map, probs and side rows equal
    the separate map + scatter, with N at, below and above the (padded) routed count."""
    if one_launch and t * next_pow2(e) > SMALL_MAP_BYTES:
        pytest.skip("the one-launch form serves small masks (each program reads it all)")
    if align > 1 and (e > 256 or (one_launch and e > 64)) and kdevice == "cpu":
        pytest.skip("interpreter time: E fill programs (each counting the whole mask when "
                    "one_launch); the smaller cases cover padding")
    ids, mask = routing(t, e, k, kind, kdevice)
    routed = int(((mask.sum(0) + align - 1) // align * align).sum())
    x = torch.randn(t, h + 3, device=kdevice)[:, :h]  # a row stride past H
    probs = torch.rand(t, e, device=kdevice)
    side = torch.randn(t, 5, device=kdevice)
    # several count blocks (tokens before t inside t's block) with small inputs
    counts = [(None, None)] if one_launch else [(None, None), (4, 1), (1, 1)]
    tokens = [1, 4, 2] if one_launch else [2, 4, 1]  # tokens per program (divides blocks)
    # fp64 probs (Megatron's fp64 routers) in the third case: permuted probs keep the dtype
    inputs = ((mask, None, None), (mask.to(torch.int32), probs, side),
              (mask, probs.double(), side.view(torch.uint8)[:, :7]))
    for i, n in enumerate((routed, routed // 2, routed + 70)):
        m, p, sd = inputs[i]
        out = torch.full((n, h), float("nan"), device=kdevice)
        bt, warps = counts[i % len(counts)]
        tiling = FusedMaskTiling(block_t=bt, map_warps=warps, tokens=tokens[i],
                                 reg_routes=(None, True, False)[i], one_launch=one_launch)
        got = permute_mask_triton(x, m, n, align, p, sd, tiling, out=out)
        for g, w in zip(got, _want(x, mask, n, align, p, sd)):
            assert (g is None) == (w is None)  # None: not given
            if w is not None:
                assert_same_bits(g.cpu(), w)


def test_kernel_fp8_bits_and_no_experts(kdevice):
    t, h, e = 33, 48, 8
    ids, mask = routing(t, e, 3, "sentinels", kdevice)
    bits = torch.randint(0, 256, (t, h), dtype=torch.uint8, device=kdevice)
    for one in (False, True):
        got = permute_mask_triton(bits, mask, 80, 1, tiling=FusedMaskTiling(one_launch=one))
        want = _want(bits, mask, 80, 1, None, None)
        assert_same_bits(got[0].cpu(), want[0])
        assert torch.equal(got[3].cpu(), want[3])
    # E = 0: nothing routed, every row zero, every map row empty
    out, pp, so, rid = permute_mask_triton(bits, mask[:, :0], 5, 1)
    assert not out.any() and rid.shape == (t, 1) and not rid.any()


@pytest.mark.parametrize("pdl", [False, True], ids=["stream_order", "pdl"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda_graph"])
def test_kernel_programmatic_dependent_launch(pdl, graph):
    """Hopper: with the scan and the fused kernel launched as programmatic dependents (the
    fused programs load their rows while the scan runs, then wait for it), rows, side rows
    and map equal the reference, eagerly and replayed from a CUDA graph; the mask is large
    enough for many count blocks and waves of fused programs."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs a CUDA device of capability >= 9")
    t, h, e, k = 4096, 384, 256, 8
    _, mask = routing(t, e, k, "random", "cuda")
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    side = torch.randn(t, 3, device="cuda")
    n = t * k - 5  # a few dropped routes
    run = lambda: permute_mask_triton(x, mask, n, 1, None, side,
                                      FusedMaskTiling(one_launch=False, pdl=pdl))
    if graph:
        run()  # compile outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            got = run()
        mask.copy_(routing(t, e, k, "random", "cuda")[1])  # new routing, same buffers
        x.normal_()
        g.replay()
        torch.cuda.synchronize()
    else:
        got = run()
    want = _want(x, mask, n, 1, None, side)
    for i in (0, 2, 3):
        assert_same_bits(got[i].cpu(), want[i])


@pytest.mark.parametrize("name", ["pertensor-e4m3", "blockwise-e5m2", "mx-e4m3"])
def test_quantized_inp_passes_intact(name):
    """The passthrough rule moves the fp8 bits and the block-scale rows in one call."""
    t, h, e = 37, 256, 8
    ids, mask = routing(t, e, 2, "sentinels")
    q = qmoe.quantize(torch.randn(t, h), RECIPES[name])
    probs = torch.rand(t, e)
    for n, align in ((int(mask.sum()) - 3, 1), (200, 16)):
        got, pp, so, rid = ops.permute_mask(q, mask, probs, None, n, align)
        assert type(got) is type(q) and so is None  # (the scale rows travel inside got)
        want, pp_w, rid_w, _, _ = qmoe.moe_permute_and_pad_with_probs(
            q, probs, mask, None, align, num_out_tokens=n)
        assert_same_quantized(got, want)
        assert torch.equal(pp, pp_w) and torch.equal(rid, rid_w)


def test_autograd_reaches_inp_and_probs(device):
    t, h, e = 21, 9, 6
    ids, mask = routing(t, e, 2, "no_route_tokens", device)
    x = torch.randn(t, h, dtype=torch.float64, device=device, requires_grad=True)
    probs = torch.rand(t, e, dtype=torch.float64, device=device, requires_grad=True)
    n = int(mask.sum()) - 2  # two routes dropped: their gradient is zero

    def f(x, probs):
        out, pp, _, _ = ops.permute_mask(x, mask, probs, None, n, 4)
        return out, pp

    torch.autograd.gradcheck(f, (x, probs))


@pytest.mark.compile
def test_absent_outputs_are_none_under_compile_with_gradients(device):
    """Without probs and side rows the op returns None in their places, eager and in a
    ``fullgraph`` compiled graph whose inputs need gradients (the fake gives None alike,
    and AOT autograd carries it), with the rows' gradient equal to eager's."""
    t, h, e = 19, 24, 5
    ids, mask = routing(t, e, 2, "no_route_tokens", device)
    n = int(mask.sum()) + 3  # three rows no route fills

    def f(x):
        out, pp, so, rid = ops.permute_mask(x, mask, None, None, n, 1)
        assert pp is None and so is None
        return out * 2, rid

    x = torch.randn(t, h, device=device, requires_grad=True)
    want, rid_w = f(x)
    (gw,) = torch.autograd.grad(want.square().sum(), x)
    got, rid = torch.compile(f, fullgraph=True)(x)
    (g,) = torch.autograd.grad(got.square().sum(), x)
    assert torch.equal(got, want) and torch.equal(rid, rid_w)
    torch.testing.assert_close(g, gw, rtol=0, atol=0)

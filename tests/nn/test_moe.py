"""``qmoe.nn.MoE`` against an fp64 loop over the experts of the same math (the routing
the layer chose, its probabilities recomputed in fp64): output and every gradient above
per-recipe SQNR floors; capacity drops, sync-free and syncing buffers, recompute, edge
cases, bad input, compile with a dynamic T. The router alone in test_router.py; expert
parallelism over Gloo in tests/test_distributed.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qmoe
from qmoe.nn import MoE, load_balancing_loss
from tests.tensors.helpers import assert_same_bits, sqnr_db

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HOPPER = DEV == "cuda" and torch.cuda.get_device_capability()[0] == 9

# SQNR floors (dB) of the output and the gradients against the fp64 loop. bf16: the GEMM
# inputs and outputs round to bf16 (about 48 dB each), chained through two GEMMs and
# SwiGLU. FP8: the dispatched rows are e4m3 (about 31 dB); on Hopper the FP8 GEMMs add the
# weights' and the SwiGLU output's quantization, and the input gradients quantize the
# gradient too. MX: power-of-two scales rounded down, up to a binade coarser.
FLOORS = {"bf16": 35.0, "rowwise": 22.0, "pertensor": 20.0, "blockwise": 22.0, "mx": 20.0}
if HOPPER:  # FP8 GEMMs: the weights (both GEMMs) and the SwiGLU output quantized as well,
    # four e4m3 roundings of about 31 dB each in the forward, the gradient's in backward
    FLOORS.update(rowwise=18.0, pertensor=17.0)
RECIPES = {"bf16": None, "rowwise": qmoe.RowWise(), "pertensor": qmoe.PerTensor(),
           "blockwise": qmoe.Blockwise(), "mx": qmoe.MXFP8()}


def _layer(h=64, f=32, e=8, k=2, recipe=None, seed=0, **kw):
    torch.manual_seed(seed)
    return MoE(h, f, e, k, recipe, device=DEV, **kw)


def _reference(layer: MoE, x: torch.Tensor, routing_map: torch.Tensor):
    """fp64 output of ``layer`` on ``x`` for the kept routes ``routing_map``, and the fp64
    leaves ``(x, w_gate_up, w_down, router_weight)`` to take gradients from. The weights
    are the values the layer's GEMMs see (in its compute dtype); the router runs in fp64 (x
    is in the compute dtype)."""
    r = layer.router
    dt = layer.compute_dtype
    assert x.dtype == dt  # so that its fp64 is what the router and GEMMs read
    xd = x.detach().double().requires_grad_()
    w1 = layer.w_gate_up.detach().to(dt).double().requires_grad_()
    w2 = layer.w_down.detach().to(dt).double().requires_grad_()
    wr = r.weight.detach().double().requires_grad_()
    logits = xd @ wr.t()
    scores = logits.softmax(-1) if r.score == "softmax" else logits.sigmoid()
    chosen = layer.router(x.detach()).routing_map  # the K chosen (before capacity drops)
    w = scores * chosen
    if r.normalize:
        w = w / w.sum(-1, keepdim=True)
    probs = w * r.scale * routing_map
    out = torch.zeros_like(xd)
    f = layer.ffn
    for e in range(layer.num_experts):
        hh = xd @ w1[e]
        y = (F.silu(hh[:, :f]) * hh[:, f:]) @ w2[e]
        out = out + probs[:, e : e + 1] * y
    return out, (xd, w1, w2, wr)


def _grads(layer: MoE, x: torch.Tensor):
    return (x.grad, layer.w_gate_up.grad, layer.w_down.grad, layer.router.weight.grad)


def _check_against_reference(layer, x0, floor, g=None):
    x = x0.clone().requires_grad_()
    out, routing = layer(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    want, leaves = _reference(layer, x0, routing.routing_map)
    g = torch.randn(out.shape, device=DEV) if g is None else g
    out.float().backward(g)
    (want * g.double()).sum().backward()
    assert sqnr_db(want, out.double()) > floor
    for got, leaf in zip(_grads(layer, x), leaves):
        if leaf.grad.norm() < 1e-9:  # zero but for rounding: a normalized K = 1 router
            assert got.norm() < 1e-5
        else:
            assert sqnr_db(leaf.grad, got.double()) > floor
    return out, routing


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("t,h", [(63, 64), (1, 64), (130, 136)])
def test_matches_fp64_loop(name, t, h):
    layer = _layer(h=h, recipe=RECIPES[name])
    x0 = torch.randn(t, h, device=DEV).bfloat16()
    _, routing = _check_against_reference(layer, x0, FLOORS[name])
    assert (routing.routing_map.sum(1) == 2).all()  # dropless: every token keeps K routes
    assert routing.tokens_per_expert.sum() == 2 * t


@pytest.mark.skipif(DEV != "cpu", reason="fp32 compute is a CPU option")
def test_fp32_compute_matches_fp64_loop():
    """``compute_dtype=torch.float32`` (CPU): fp32 rows, GEMMs and SwiGLU, far above the
    bf16 floor (the SwiGLU's torch path works on its own fp32 buffers, not on h)."""
    layer = _layer(h=64, compute_dtype=torch.float32)
    x0 = torch.randn(63, 64, device=DEV)
    _check_against_reference(layer, x0, 100.0)


def test_deepseek_router_and_3d_input():
    """Sigmoid scores, a selection bias, group-limited routing, scaled weights; x [B, S, H]."""
    layer = _layer(e=16, k=4, score="sigmoid", score_bias=True, num_groups=4,
                   topk_groups=2, scale=2.5)
    layer.router.bias.copy_(torch.randn(16, device=DEV))
    x0 = torch.randn(3, 21, 64, device=DEV).bfloat16()
    x = x0.clone().requires_grad_()
    out, routing = layer(x)
    assert out.shape == (3, 21, 64)
    want, _ = _reference(layer, x0.reshape(-1, 64), routing.routing_map)
    assert sqnr_db(want, out.reshape(-1, 64).double()) > FLOORS["bf16"]
    torch.testing.assert_close(routing.probs.sum(1), torch.full((63,), 2.5, device=DEV))


def test_capacity_keeps_each_experts_first_routes():
    """``capacity_factor``: expert e keeps its first C = ceil(cf * T * K / E) routes in
    token order; the rest are dropped from the output (not its other experts' share)."""
    t, e, k, cf = 50, 8, 2, 0.5
    layer = _layer(e=e, k=k, capacity_factor=cf)
    with torch.no_grad():  # a skewed router: some experts get far more than C routes
        layer.router.weight[:3] += 0.5
    x0 = torch.randn(t, 64, device=DEV).bfloat16()
    chosen = layer.router(x0).routing_map
    c = -(-t * k // (2 * e))
    want_map = chosen & (chosen.int().cumsum(0) <= c)
    assert (chosen.sum(0) > c).any()  # something is dropped
    out, routing = _check_against_reference(layer, x0, FLOORS["bf16"])
    assert torch.equal(routing.routing_map, want_map)
    assert torch.equal(routing.tokens_per_expert, want_map.sum(0).int())
    assert (routing.probs[~want_map] == 0).all()
    assert routing.tokens_per_expert.max() <= c


def test_one_expert_takes_all_and_empty_experts():
    layer = _layer(e=8, k=1, recipe=qmoe.RowWise(), score="sigmoid", score_bias=True)
    layer.router.bias.copy_(torch.tensor([0, 0, 0, 0, 0, 50.0, 0, 0], device=DEV))
    x0 = torch.randn(40, 64, device=DEV).bfloat16()
    _, routing = _check_against_reference(layer, x0, FLOORS["rowwise"])
    assert routing.tokens_per_expert.tolist() == [0] * 5 + [40] + [0] * 2


def test_empty_input():
    layer = _layer(recipe=qmoe.RowWise())
    x = torch.zeros(0, 64, device=DEV, requires_grad=True)
    out, routing = layer(x)
    out.sum().backward()
    assert out.shape == (0, 64) and (layer.w_down.grad == 0).all()
    assert routing.tokens_per_expert.tolist() == [0] * 8


@pytest.mark.parametrize("name", ["bf16", "rowwise"])
@pytest.mark.parametrize("cf", [None, 0.75])
def test_syncing_buffer_is_bit_identical(name, cf):
    """``static_shapes=False`` (exact rows, one host sync) gives what the sync-free bound
    gives, bit for bit, output and gradients."""
    x0 = torch.randn(45, 64, device=DEV).bfloat16()

    def run(static):
        layer = _layer(recipe=RECIPES[name], capacity_factor=cf, static_shapes=static)
        x = x0.clone().requires_grad_()
        out, _ = layer(x)
        out.float().square().sum().backward()
        return (out, *_grads(layer, x))

    for a, b in zip(run(True), run(False)):
        assert_same_bits(a, b)


@pytest.mark.parametrize("name", ["bf16", "rowwise"])
def test_recompute_gives_identical_gradients(name):
    x0 = torch.randn(33, 64, device=DEV).bfloat16()

    def run(recompute):
        layer = _layer(recipe=RECIPES[name], recompute=recompute)
        x = x0.clone().requires_grad_()
        out, routing = layer(x)
        (out.float().square().sum() + load_balancing_loss(routing.routing())).backward()
        return (out, *_grads(layer, x))

    for a, b in zip(run(True), run(False)):
        assert_same_bits(a, b)


def test_bad_input():
    with pytest.raises(TypeError, match="recipe must be None"):
        MoE(64, 32, 8, 2, "fp8")
    for cf in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="capacity_factor must be positive and finite"):
            MoE(64, 32, 8, 2, capacity_factor=cf)
    with pytest.raises(ValueError, match=r"hidden \(60\) and ffn \(32\) must be multiples of 8"):
        MoE(60, 32, 8, 2)
    with pytest.raises(TypeError, match="compute_dtype must be torch.bfloat16"):
        MoE(64, 32, 8, 2, compute_dtype=torch.float16)
    layer = _layer(recipe=qmoe.RowWise())
    with pytest.raises(TypeError, match=r"weights_fp8 must be the \(gate_up, down\) pair"):
        layer(torch.randn(4, 64, device=DEV), weights_fp8=layer.quantize_weights()[0])
    with pytest.raises(ValueError, match=r"x must be \[T, H\]"):
        layer.router(torch.randn(2, 3, 64, device=DEV))
    with pytest.raises(ValueError, match="top_k must be in"):
        MoE(64, 32, 8, 9)
    with pytest.raises(ValueError, match="num_groups"):
        MoE(64, 32, 8, 2, num_groups=3)
    with pytest.raises(ValueError, match=r"x must be \[..., H=64\]"):
        _layer()(torch.randn(4, 32, device=DEV))


def _count_compiles():
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


@pytest.mark.compile
@pytest.mark.parametrize("name", ["bf16", "rowwise"] + (
    ["pertensor", "blockwise", "mx"] if DEV == "cuda" else []))
def test_compile_dynamic_tokens_no_recompile(name):
    """Forward and backward under ``torch.compile(fullgraph=True)`` with T marked dynamic
    (``torch._dynamo.mark_dynamic(x, 0)``, docs/nn.md) at T 64, 96 and 128: one graph for
    all three, each within the recipe's floor of the eager layer (the compiled SwiGLU
    skips a bf16 rounding)."""
    torch._dynamo.reset()
    h = 48  # a multiple of 16: the FP8 GEMMs run on Hopper (and not a T: no duck sizing)
    layer = _layer(h=h, recipe=RECIPES[name], capacity_factor=1.25)
    compiled = torch.compile(layer, fullgraph=True)
    before = _count_compiles()
    for t in (64, 96, 128):
        x0 = torch.randn(t, h, device=DEV).bfloat16()
        outs = []
        for fn in (compiled, layer):
            layer.zero_grad()
            x = x0.clone().requires_grad_()
            torch._dynamo.mark_dynamic(x, 0)
            out, routing = fn(x)
            out.float().square().sum().backward()
            outs.append((out, routing.routing_map, x.grad, layer.w_down.grad.clone()))
        (co, cm, cx, cw), (eo, em, ex, ew) = outs
        assert torch.equal(cm, em)
        assert sqnr_db(eo, co) > FLOORS[name] + 5
        assert sqnr_db(ex, cx) > FLOORS[name] + 5
        assert sqnr_db(ew, cw) > FLOORS[name] + 5
    assert _count_compiles() - before == 1


@pytest.mark.parametrize("name", ["bf16", "rowwise"])
def test_prequantized_weights_are_bit_identical(name):
    """``forward(x, weights_fp8=layer.quantize_weights())`` gives what quantizing in the
    call gives (the FP8 GEMMs read the given bits on Hopper; other paths ignore them),
    output and every gradient, with and without recompute."""
    x0 = torch.randn(29, 64, device=DEV).bfloat16()

    def run(pre, recompute):
        layer = _layer(recipe=RECIPES[name], recompute=recompute)
        x = x0.clone().requires_grad_()
        out, _ = layer(x, weights_fp8=layer.quantize_weights() if pre else None)
        out.float().square().sum().backward()
        return (out, *_grads(layer, x))

    want = run(False, False)
    for got in (run(True, False), run(True, True)):
        for a, b in zip(got, want):
            assert_same_bits(a, b)


@pytest.mark.parametrize("t,e,k,cf", [(1, 64, 8, None), (40, 8, 2, 4.0), (40, 8, 2, 1e-7),
                                      (0, 8, 2, 1.0)])
def test_buffer_bound_and_tiny_capacity(t, e, k, cf):
    """The sync-free buffer bound (min of the dropless bound and the capacity's) gives what
    the exact buffer gives, bit for bit; a capacity factor too small for one route still
    keeps each used expert's first route (C = ceil(cf * T * K / E) >= 1, exact)."""
    x0 = torch.randn(t, 64, device=DEV).bfloat16()
    outs = []
    for static in (True, False):
        layer = _layer(e=e, k=k, recipe=qmoe.RowWise(), capacity_factor=cf,
                       static_shapes=static)
        out, routing = layer(x0)
        outs.append((out, routing.tokens_per_expert))
    assert_same_bits(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])
    if cf == 1e-7 and t:
        tpe = outs[0][1]
        assert tpe.max() == 1 and (tpe > 0).sum() == routing.chosen_map.any(0).sum()


def test_balancing_loss_sees_routes_before_capacity():
    """``MoERouting.routing()`` gives the router's choice (before drops), so the balance
    loss sees an expert that every token picks even when capacity keeps few of them."""
    layer = _layer(e=4, k=2, capacity_factor=1.0, score="sigmoid", score_bias=True)
    layer.router.bias.copy_(torch.tensor([50.0, 0, 0, 0], device=DEV))
    _, routing = layer(torch.randn(40, 64, device=DEV).bfloat16())
    assert routing.chosen_map[:, 0].all() and routing.tokens_per_expert[0] == 20
    assert torch.equal(routing.routing().routing_map, routing.chosen_map)
    s = routing.scores / routing.scores.sum(-1, keepdim=True)
    f = routing.chosen_map.sum(0) / 80  # expert 0: half of all routes, before the drops
    torch.testing.assert_close(load_balancing_loss(routing.routing()),
                               4 * (f * s.mean(0)).sum())
    balanced = qmoe.nn.Routing(routing.probs, torch.eye(4, dtype=torch.bool, device=DEV),
                               torch.rand(4, 4, device=DEV))
    torch.testing.assert_close(load_balancing_loss(balanced),
                               torch.tensor(1.0, device=DEV))  # sigmoid scores normalized

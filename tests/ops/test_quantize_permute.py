"""Fused quantize-and-permute: bit for bit ``moe_permute(qmoe.quantize(x, recipe))``."""

import contextlib
import itertools

import pytest
import torch

import qmoe
from qmoe.ops import reference as R
from qmoe.ops.quantize_permute import (
    _two_step,
    quantize_permute_mask_triton,
    quantize_permute_triton,
)
from qmoe.ops.tuning import QuantizePermuteTiling
from qmoe.tensors.quantize import per_tensor_scale, recipe_scale_mode
from qmoe.tensors.recipes import block_size_of
from tests.ops.helpers import reference_routes, routing
from tests.tensors.helpers import (
    RECIPES,
    assert_same_bits,
    assert_same_quantized,
    skip_wide_rowwise,
    tiny_mx_blocks,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _args(recipe, x):
    if isinstance(recipe, qmoe.PerTensor):
        return 0, recipe.fp8_dtype, "given", per_tensor_scale(x, recipe)
    return (block_size_of(recipe, x.shape[-1]), recipe.fp8_dtype, recipe_scale_mode(recipe),
            None)


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("t,h,e,k,kind,extra", [
    (1, 17, 4, 2, "random", 0), (63, 160, 8, 3, "sentinels", -9), (40, 300, 16, 4,
                                                                    "empty_experts", 7),
    (2, 7168, 8, 2, "random", 0), (3, 4100, 8, 3, "sentinels", 2),  # 4096-column tiles
    (3, 2880, 16, 4, "random", -2),  # gpt-oss's H: three 1024-column steps a program
])
def test_fused_kernel_matches_two_steps(kdevice, recipe, t, h, e, k, kind, extra):
    """The Triton kernel (CUDA, or the interpreter) against quantize then permute."""
    r = RECIPES[recipe]
    skip_wide_rowwise(r, h)
    ids, mask = routing(t, e, k, kind, kdevice)
    n = max(0, int(mask.sum()) + extra)
    # fp16 rows too, under the interpreter on the few-token cases only (its time)
    for dtype in ((torch.float32, torch.bfloat16, torch.float16)
                  if kdevice == "cuda" or t <= 3 else (torch.float32, torch.bfloat16)):
        x = (torch.randn(t, h, device=kdevice) * torch.logspace(-2, 2, h, device=kdevice)).to(dtype)
        probs = torch.rand(t, e, device=kdevice)
        for rm, is_index in ((mask, False), (ids, True)):
            rid, fill = torch.ops.qmoe.make_row_id_map(rm, n, is_index, 1)
            p = probs if not is_index else probs[:, :k].double()  # fp64 probs too
            want = _two_step(x.cpu(), rid.cpu(), p.cpu(), n, *_args(r, x.cpu()))
            # rows no route writes: flagged pass, or zeroed in-launch; the default tiling
            # (at H >= 4096 one step a program), and on CUDA the wide rows also in one
            # program (steps=0; guards against the wrong bits that loading chunk i + 1
            # before chunk i's stores gave on an H100)
            for f, steps in itertools.product(
                    (None, fill), (1, 0) if kdevice == "cuda" and h >= 4096 else (None,)):
                got = quantize_permute_triton(x, rid, p, n, *_args(r, x), f,
                                              QuantizePermuteTiling(steps=steps), poison=True)
                for a, b in zip(got, want):
                    assert_same_bits(a.cpu(), b)
            if not is_index and h >= 4096:  # the mask kernel's wide rows (two steps), on
                # the same inputs; its narrow rows: test_mask_kernel_matches_map_then_fused
                got = quantize_permute_mask_triton(x, mask, n, 1, p, *_args(r, x), poison=True)
                assert_same_bits(got[3], rid)
                for a, b in zip(got[:3], want):
                    assert_same_bits(a.cpu(), b)


# a block size other than DeepSeek-V3's 128 (Blockwise takes powers of two in [16, 1024])
OTHER_BLOCKS = {"blockwise64-e5m2": qmoe.Blockwise(block_size=64, fp8_dtype=torch.float8_e5m2),
                "blockwise16-e4m3": qmoe.Blockwise(block_size=16)}


@pytest.mark.parametrize("recipe", ["blockwise-e4m3", "mx-e5m2", "pertensor-e4m3",
                                    *OTHER_BLOCKS])
def test_fused_kernel_zeroes_padding_and_tail(kdevice, recipe):
    """A padded map with spare rows: every padding row and the tail come out zero (into
    poisoned outputs), with the map's fill ranges or with flags."""
    r = {**RECIPES, **OTHER_BLOCKS}[recipe]
    t, h, e = 45, 96, 8
    _, mask = routing(t, e, 3, "empty_experts", kdevice)
    n = 220
    rid, fill = torch.ops.qmoe.make_row_id_map(mask, n, False, 16)
    x = torch.randn(t, h, device=kdevice)
    p = torch.rand(t, e, device=kdevice)
    want = _two_step(x.cpu(), rid.cpu(), p.cpu(), n, *_args(r, x.cpu()))
    for f in (None, fill):
        got = quantize_permute_triton(x, rid, p, n, *_args(r, x), f, poison=True)
        for a, b in zip(got, want):
            assert_same_bits(a.cpu(), b)


@pytest.mark.parametrize("recipe,h", [("blockwise-e4m3", 300), ("mx-e5m2", 300),
                                       ("pertensor-e4m3", 1100)])
def test_fused_kernels_step_over_columns(kdevice, recipe, h):
    """Programs that take a row in several steps (``tile`` columns each, ``steps`` a
    program, 0: the whole row; the last step running past the row): both kernels give the
    bits of quantize then permute into poisoned outputs, with fill ranges or flags, a
    padded map, routes from registers or read back, two routes an iteration (K = 3)."""
    r = RECIPES[recipe]
    t, e = 37, 8
    _, mask = routing(t, e, 3, "empty_experts", kdevice)
    x = (torch.randn(t, h, device=kdevice) * torch.logspace(-2, 2, h, device=kdevice)).to(
        torch.bfloat16)
    p = torch.rand(t, e, device=kdevice)
    block = 512 if isinstance(r, qmoe.PerTensor) else r.block_size
    unit = block * (4 if block == 32 else 1)  # MX: 4 blocks a step (interpreter time)
    for align in (1, 4):
        n = int(((mask.sum(0) + align - 1) // align * align).sum()) + 6
        rid, fill = torch.ops.qmoe.make_row_id_map(mask, n, False, align)
        want = _two_step(x.cpu(), rid.cpu(), p.cpu(), n, *_args(r, x.cpu()))
        # tilings: a row a program in tile-wide steps, two steps a program, a tile that runs
        # past the row's end; the unpadded map takes the first and third, the padded the second
        for tile, steps in ((unit, 0), (2 * unit, 0)) if align == 1 else ((unit, 2),):
            for f in (None, fill) if align == 1 else (fill,):
                got = quantize_permute_triton(x, rid, p, n, *_args(r, x), f,
                                              QuantizePermuteTiling(tile, steps, kb=2),
                                              poison=True)
                for a, b in zip(got, want):
                    assert_same_bits(a.cpu(), b)
            tiling = QuantizePermuteTiling(tile, steps, kb=2, reg_routes=align == 1)
            got = quantize_permute_mask_triton(x, mask, n, align, p, *_args(r, x), tiling,
                                               poison=True)
            assert_same_bits(got[3], rid)
            for a, b in zip(got[:3], want):
                assert_same_bits(a.cpu(), b)


MASK_CASES = [  # (T, H, E, K, kind, align, N relative to the padded routed count)
    (1, 17, 4, 2, "random", 1, 0), (63, 160, 8, 3, "sentinels", 16, 40),
    (40, 300, 16, 4, "empty_experts", 1, -9), (20, 64, 5, 1, "one_expert", 4, 0),
    (33, 96, 256, 8, "no_route_tokens", 1, 5),
]
# Every case with one recipe per layout (fp8 dtypes alternating), the other recipes on one
# case each, and hidden sizes that take the 4096-column tiles.
_MASK_RECIPES = ["blockwise-e4m3", "mx-e5m2", "pertensor-e5m2"]
MASK_PARAMS = (
    [(r, *c) for r in _MASK_RECIPES for c in MASK_CASES]
    + [(r, 21, 96, 16, 4, "sentinels", 8, 3)
       for r in RECIPES if r not in _MASK_RECIPES]
    + [(r, 2, h, 8, 3, "random", 4, 1)
       for r, h in (("blockwise-e5m2", 7168), ("mx-e4m3", 4100), ("pertensor-e4m3", 4096))]
)


@pytest.mark.parametrize("recipe,t,h,e,k,kind,align,extra", MASK_PARAMS)
def test_mask_kernel_matches_map_then_fused(kdevice, recipe, t, h, e, k, kind, align, extra):
    """The fused kernel that builds its map rows itself (``quantize_permute_mask``): the
    map, bits, scales and probs equal ``make_row_id_map`` then the fused kernel on it, into
    poisoned outputs; both launch forms, several count tilings, with and without probs."""
    r = RECIPES[recipe]
    _, mask = routing(t, e, k, kind, kdevice)
    routed = int(((mask.sum(0) + align - 1) // align * align).sum())
    n = max(0, routed + extra)
    x = (torch.randn(t, h + 5, device=kdevice) * 3)[:, :h].to(torch.bfloat16)  # row stride
    probs = torch.rand(t, e, device=kdevice)
    rid, fill = torch.ops.qmoe.make_row_id_map(mask, n, False, align)
    # (one launch, count tiling, routes from registers or read back from the stored map)
    forms = [QuantizePermuteTiling(one_launch=True),
             QuantizePermuteTiling(one_launch=False, reg_routes=True),
             QuantizePermuteTiling(block_t=4, map_warps=1, one_launch=False, reg_routes=False)]
    for i, tiling in enumerate(forms):
        one = tiling.one_launch
        if align > 1 and e > 64 and one and kdevice == "cpu":
            continue  # interpreter time: E fill programs each counting the whole mask
        p = probs if i != 1 else None
        want = quantize_permute_triton(x, rid, p, n, *_args(r, x), fill)
        got = quantize_permute_mask_triton(x, mask if i else mask.to(torch.int32), n, align, p,
                                           *_args(r, x), tiling, poison=True)
        assert_same_bits(got[3], rid)
        for a, b in zip(got[:3], want):
            assert_same_bits(a, b)


def _tiny_routes(fp8):
    """MX blocks below the OCP exponent -126 (``tiny_mx_blocks``), each token sent to two
    experts, and the rows and scale bytes the permute must give (reference permute)."""
    x, want = tiny_mx_blocks(fp8)
    _, mask = routing(x.shape[0], 4, 2, "random")
    n = 2 * x.shape[0]
    rows = R.permute(x, mask, "mask", n)[0]
    return x, mask, n, rows, R.permute(want, mask, "mask", n)[0]


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fused_kernels_mx_tiny_blocks(kdevice, fp8):
    """The fused kernels store byte 1 (the divisor 2**-126 they used) for nonzero MX blocks
    below the OCP exponent -126, byte 0 for all-zero ones: the rows dequantize exactly."""
    x, mask, n, rows, bytes_ = _tiny_routes(fp8)
    x, mask = x.to(kdevice), mask.to(kdevice)
    rid, fill = torch.ops.qmoe.make_row_id_map(mask, n, False, 1)
    args = (32, fp8, "mx_floor", None)
    for q, s, _ in (quantize_permute_triton(x, rid, None, n, *args, poison=True),
                    quantize_permute_triton(x, rid, None, n, *args, fill, poison=True),
                    quantize_permute_mask_triton(x, mask, n, 1, None, *args, poison=True)[:3]):
        assert_same_bits(s.cpu(), bytes_)
        assert torch.equal(qmoe.MXFP8Tensor(q.cpu(), s.cpu(), torch.float32).dequantize(), rows)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_public_quantize_mx_tiny_blocks(fp8):
    """``moe_permute(..., quantize=qmoe.MXFP8())`` on this machine's path (CPU: the op's
    two steps on the C++ kernels when built): tiny MX blocks dequantize exactly."""
    x, mask, n, rows, bytes_ = _tiny_routes(fp8)
    out, _ = qmoe.moe_permute(x.to(DEV), mask.to(DEV), n, quantize=qmoe.MXFP8(fp8))
    assert_same_bits(out.scale_bits.cpu(), bytes_)
    assert torch.equal(out.dequantize().cpu(), rows)


@pytest.mark.parametrize("recipe", ["mx-e4m3", "blockwise-e5m2", "pertensor-e4m3"])
def test_fused_launchers_with_no_columns_or_tokens(kdevice, recipe):
    """H = 0 (no columns: empty bits and scale rows, no quantize launch; the probs still
    move) and T = 0 (every output row unwritten): the launchers equal the two steps."""
    r = RECIPES[recipe]
    for t, h in ((6, 0), (0, 64), (0, 0)):
        _, mask = routing(t, 4, 2, "random", kdevice)
        x, probs = torch.randn(t, h, device=kdevice), torch.rand(t, 4, device=kdevice)
        for n in (0, int(mask.sum()), int(mask.sum()) + 3):
            rid, fill = torch.ops.qmoe.make_row_id_map(mask, n, False, 1)
            for p, f in itertools.product((probs, None), (None, fill)):
                want = _two_step(x.cpu(), rid.cpu(), None if p is None else p.cpu(), n,
                                 *_args(r, x.cpu()))
                got = quantize_permute_triton(x, rid, p, n, *_args(r, x), f, poison=True)
                for a, b in zip(got, want):
                    assert_same_bits(a.cpu(), b)
            got = quantize_permute_mask_triton(x, mask, n, 1, probs, *_args(r, x), poison=True)
            assert_same_bits(got[3], rid)
            for a, b in zip(got[:3], _two_step(x.cpu(), rid.cpu(), probs.cpu(), n,
                                               *_args(r, x.cpu()))):
                assert_same_bits(a.cpu(), b)


def test_mask_kernel_no_tokens_or_experts(kdevice):
    r = RECIPES["mx-e4m3"]
    for t, e, n in ((0, 4, 6), (5, 0, 3)):
        x = torch.randn(t, 64, device=kdevice)
        mask = torch.zeros(t, e, dtype=torch.bool, device=kdevice)
        q, s, pp, rid = quantize_permute_mask_triton(x, mask, n, 1, None, *_args(r, x),
                                                     poison=True)
        assert q.shape == (n, 64) and not q.view(torch.uint8).any() and not s.any()
        assert rid.shape == (t, 2 * e + 1) and not rid[:, -1].any()
        assert (rid[:, :-1] == -1).all()


# one recipe per layout and fp8 dtype
FP8_RECIPES = [f"{layout}-{dt}" for layout in ("pertensor", "blockwise", "mx")
               for dt in ("e4m3", "e5m2")]


@pytest.mark.parametrize("recipe", [*RECIPES, *OTHER_BLOCKS])
def test_public_functions_with_quantize(recipe):
    """Each public function with ``quantize=`` against ``qmoe.quantize`` then the function,
    for every recipe (on CUDA the fused kernels; elsewhere the op's two steps)."""
    r = {**RECIPES, **OTHER_BLOCKS}[recipe]
    t, h, e, k = 50, 256, 8, 2
    ids, mask = routing(t, e, k, "sentinels", DEV)
    x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
    probs = torch.rand(t, e, device=DEV)
    q = qmoe.quantize(x, r)
    n = int(mask.sum()) - 3
    a, rid = qmoe.moe_permute(x, ids, n, map_type="index", quantize=r)
    b, _ = qmoe.moe_permute(q, ids, n, map_type="index")
    assert_same_quantized(a, b)
    # with num_experts (on CUDA the two-step side then takes qmoe::permute_index)
    a, _ = qmoe.moe_permute(x, ids, n, map_type="index", num_experts=e, quantize=r)
    b, _ = qmoe.moe_permute(q, ids, n, map_type="index", num_experts=e)
    assert_same_quantized(a, b)
    a, pa, _ = qmoe.moe_permute_with_probs(x, probs, mask, n, quantize=r)
    b, pb, _ = qmoe.moe_permute_with_probs(q, probs, mask, n)
    assert_same_quantized(a, b)
    assert_same_bits(pa, pb)
    for bound in (None, t * k + e * 16):
        a = qmoe.moe_permute_and_pad_with_probs(x, probs, mask, None, 16, num_out_tokens=bound,
                                                quantize=r)
        b = qmoe.moe_permute_and_pad_with_probs(q, probs, mask, None, 16, num_out_tokens=bound)
        assert_same_quantized(a[0], b[0])
        assert_same_bits(a[1], b[1])
    if isinstance(r, qmoe.PerTensor):  # a given scale
        s = torch.tensor(0.01, device=DEV)
        a, _ = qmoe.moe_permute(x, mask, n, quantize=r, quantize_scale=s)
        b, _ = qmoe.moe_permute(qmoe.quantize(x, r, scale=s), mask, n)
        assert_same_quantized(a, b)


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_public_map_built_in_the_fused_launch(recipe, monkeypatch):
    """N >= 6T: on CUDA the mask calls take ``quantize_permute_mask`` (the map built inside
    the fused launch; elsewhere the op's map-then-fused form, forced here): outputs, map and
    gradients equal quantize then permute, the pad variant's both forms included."""
    import qmoe.ops.quantize_permute as QP

    if DEV == "cpu":
        monkeypatch.setattr(QP, "_map_in_launch", lambda x, is_index, n: not is_index)
    r = RECIPES[recipe]
    t, h, e, k = 37, 160, 16, 8
    _, mask = routing(t, e, k, "no_route_tokens", DEV)
    x0 = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
    p0 = torch.rand(t, e, device=DEV)
    n = t * k
    assert QP._map_in_launch(x0, False, n)
    outs = []
    for fused in (True, False):
        x, p = x0.clone().requires_grad_(), p0.clone().requires_grad_()
        inp, kw = (x, {"quantize": r}) if fused else (qmoe.quantize(x, r), {})
        out, pp, rid = qmoe.moe_permute_with_probs(inp, p, mask, n, **kw)
        y = qmoe.moe_unpermute(out.dequantize() * pp[:, None].to(out.dtype), rid)
        y.float().square().sum().backward()
        pads = [qmoe.moe_permute_and_pad_with_probs(inp.detach(), p0, mask, None, 16,
                                                    num_out_tokens=bound, **kw)
                for bound in (None, n + e * 16)]
        outs.append((out, pp, rid, x.grad, p.grad, pads))
    a, b = outs
    assert_same_quantized(a[0], b[0])
    for u, v in zip(a[1:5], b[1:5]):
        assert_same_bits(u, v)
    for pa, pb in zip(a[5], b[5]):
        assert_same_quantized(pa[0], pb[0])
        for u, v in zip(pa[1:], pb[1:]):  # probs, map, pad_offsets (or None), targets
            assert (u is None) == (v is None)
            if u is not None:
                assert_same_bits(u, v)


@pytest.mark.parametrize("map_type", ["mask", "index"])
@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_backward_matches_two_steps(recipe, map_type):
    r = RECIPES[recipe]
    t, h, e, k = 30, 128, 6, 2
    ids, mask = routing(t, e, k, "random", DEV)
    rm, cols = (mask, e) if map_type == "mask" else (ids, k)
    x0 = torch.randn(t, h, device=DEV)
    p0 = torch.rand(t, cols, device=DEV)
    grads = []
    for fused in (True, False):
        x, p = x0.clone().requires_grad_(), p0.clone().requires_grad_()
        inp, kw = (x, {"quantize": r}) if fused else (qmoe.quantize(x, r), {})
        out, pp, rid = qmoe.moe_permute_with_probs(inp, p, rm, t * k - 5, map_type=map_type,
                                                   **kw)
        y = qmoe.moe_unpermute(out.dequantize() * pp[:, None], rid, map_type=map_type)
        y.square().sum().backward()
        grads.append((x.grad, p.grad))
    assert grads[0][0] is not None and grads[0][0].dtype == torch.float32
    for a, b in zip(*grads):
        assert_same_bits(a, b)


def test_opcheck_and_fake():
    t, h, e = 12, 64, 4
    _, mask = routing(t, e, 2, "random", DEV)
    x = torch.randn(t, h, device=DEV)
    probs = torch.rand(t, e, device=DEV)
    for n in (0, int(mask.sum()), int(mask.sum()) + 3):
        rid, fill = torch.ops.qmoe.make_row_id_map(mask, n, False, 1)
        for args in ((32, torch.float8_e4m3fn, "mx_floor", None),
                     (128, torch.float8_e5m2, "pow2", None),
                     (0, torch.float8_e4m3fn, "given", torch.tensor(0.05, device=DEV)),
                     # a [1] scale: the output scale is [] still (the fake's shape)
                     (0, torch.float8_e4m3fn, "given", torch.tensor([0.05], device=DEV))):
            for p in (probs, None):
                torch.library.opcheck(torch.ops.qmoe.quantize_permute.default,
                                      (x, rid, p, n, *args))
            torch.library.opcheck(torch.ops.qmoe.quantize_permute.default,
                                  (x, rid, probs, n, *args, fill))
    for n, align in ((int(mask.sum()), 1), (int(mask.sum()) + 20, 8)):
        torch.library.opcheck(torch.ops.qmoe.quantize_permute_mask.default,
                              (x, mask, probs, n, align, 128, torch.float8_e4m3fn, "amax",
                               None))
        torch.library.opcheck(torch.ops.qmoe.quantize_permute_mask.default,
                              (x, mask, None, n, align, 0, torch.float8_e5m2, "given",
                               torch.tensor(0.05, device=DEV)))
    torch.library.opcheck(torch.ops.qmoe.quantize_permute_mask.default,
                          (x[:0], mask[:0], probs[:0], 0, 1, 32, torch.float8_e4m3fn,
                           "mx_floor", None))
    empty = torch.randn(0, h, device=DEV)
    rid, _ = torch.ops.qmoe.make_row_id_map(mask[:0], 0, False, 1)
    torch.library.opcheck(torch.ops.qmoe.quantize_permute.default,
                          (empty, rid, None, 0, 128, torch.float8_e4m3fn, "amax", None))
    n = int(mask.sum())  # no columns: [N, 0] bits, [N, 0] scales
    rid, _ = torch.ops.qmoe.make_row_id_map(mask, n, False, 1)
    torch.library.opcheck(torch.ops.qmoe.quantize_permute.default,
                          (x[:, :0], rid, probs, n, 32, torch.float8_e4m3fn, "mx_floor", None))
    torch.library.opcheck(torch.ops.qmoe.quantize_permute_mask.default,
                          (x[:, :0], mask, probs, n, 1, 128, torch.float8_e5m2, "amax", None))


def test_ops_autograd_probs_only():
    """The ops' own autograd: ``permuted_probs`` carries the gradient to ``probs``; the
    fp8 bits, scales and map take none, so ``x`` gets none
    from the op itself (the public functions pass it straight through)."""
    t, h, e = 30, 96, 8
    _, mask = routing(t, e, 3, "empty_experts", DEV)
    n = int(mask.sum()) - 2  # two routes dropped
    rid, fill = torch.ops.qmoe.make_row_id_map(mask, n, False, 1)
    g = torch.randn(n, device=DEV)
    x0, p0 = torch.randn(t, h, device=DEV), torch.rand(t, e, device=DEV)
    # the probs' gradient from the reference's routes (qmoe.ops.reference): g at each kept
    # route's row, zero elsewhere
    want = torch.zeros(t, e)
    rows, toks, cols = reference_routes(mask, "mask", n)
    want[toks, cols] = g.cpu()[rows]
    for op, args in ((torch.ops.qmoe.quantize_permute.default,
                      lambda x, p: (x, rid, p, n, 32, torch.float8_e4m3fn, "mx_floor", None,
                                    fill)),
                     (torch.ops.qmoe.quantize_permute_mask.default,
                      lambda x, p: (x, mask, p, n, 1, 128, torch.float8_e5m2, "amax", None))):
        x, p = x0.clone().requires_grad_(), p0.clone().requires_grad_()
        out = op(*args(x, p))
        assert [o.requires_grad for o in out] == [False, False, True] + [False] * (len(out) - 3)
        out[2].backward(g)
        assert x.grad is None
        assert_same_bits(p.grad.cpu(), want)
        # opcheck's forward-backward test sums every output, and fp8 has no sum: the rest
        torch.library.opcheck(op, args(x, p), test_utils=(
            "test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.parametrize("fake", [False, True])
def test_ops_refuse_bad_quantizing_arguments(fake):
    from torch._subclasses.fake_tensor import FakeTensorMode

    t, h, e = 6, 64, 4
    _, mask = routing(t, e, 2, "random", DEV)
    n = int(mask.sum())
    rid, _ = torch.ops.qmoe.make_row_id_map(mask, n, False, 1)
    x, one = torch.randn(t, h, device=DEV), torch.tensor(0.1, device=DEV)
    e4 = torch.float8_e4m3fn
    cases = [((32, torch.float16, "mx_floor", None), TypeError, "fp8_dtype must be"),
             ((0, e4, "amax", None), ValueError, "block_size must be a power of two"),
             ((128, e4, "absmax", None), ValueError, "scale_mode must be one of"),
             ((128, e4, "amax", one), ValueError, "scale is only taken with"),
             ((0, e4, "given", None), ValueError, "scale_mode=.given. needs a one-element"),
             ((0, e4, "given", torch.tensor(1, device=DEV)), TypeError,
              "scale must be a float tensor, got torch.int64"),
             ((0, e4, "given", one.repeat(2)), ValueError, "scale must be a one-element")]
    if DEV == "cuda":  # a CPU scale beside CUDA rows
        cases.append(((0, e4, "given", one.cpu()), ValueError, "scale is on cpu but x is on"))
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    with mode:
        for args, err, msg in cases:
            with pytest.raises(err, match="qmoe::quantize_permute: " + msg):
                torch.ops.qmoe.quantize_permute(x, rid, None, n, *args)
            with pytest.raises(err, match="qmoe::quantize_permute_mask: " + msg):
                torch.ops.qmoe.quantize_permute_mask(x, mask, None, n, 1, *args)
        with pytest.raises(ValueError, match="x must be 2-D"):
            torch.ops.qmoe.quantize_permute(x[None], rid, None, n, 32, e4, "mx_floor", None)


@pytest.mark.compile
def test_fused_path_compiles_fullgraph():
    t, h, e, k = 40, 128, 8, 2
    _, mask = routing(t, e, k, "random", DEV)
    x = torch.randn(t, h, device=DEV)
    probs = torch.rand(t, e, device=DEV)

    def f(x, probs):
        out, pp, rid = qmoe.moe_permute_with_probs(x, probs, mask, t * k, quantize=qmoe.MXFP8())
        return out, pp, qmoe.moe_unpermute(out, rid, probs)

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True)(x, probs)
    want = f(x, probs)
    assert_same_quantized(got[0], want[0])
    assert_same_bits(got[1], want[1])
    assert_same_bits(got[2], want[2])


@pytest.mark.compile
def test_map_in_launch_path_compiles_fwd_bwd(monkeypatch):
    """fullgraph=True over the pad variant's sync-free form with ``quantize=`` and the map
    built in the fused launch (``qmoe::quantize_permute_mask``; forced off CUDA), forward
    and backward: outputs and gradients equal eager's bit for bit."""
    import qmoe.ops.quantize_permute as QP

    if DEV == "cpu":
        monkeypatch.setattr(QP, "_map_in_launch", lambda x, is_index, n: not is_index)
    t, h, e, k = 24, 160, 8, 6
    _, mask = routing(t, e, k, "empty_experts", DEV)
    x0, p0 = torch.randn(t, h, device=DEV), torch.rand(t, e, device=DEV)
    w = torch.randn(t * k + e * 16, h, device=DEV)
    assert QP._map_in_launch(x0, False, w.shape[0])

    def f(x, probs):  # the FP8 output's consumer inside the graph, the output detached
        # (AOTAutograd guesses an FP8 tangent for an FP8 output: docs/tensors.md)
        out, pp, rid, _, target = qmoe.moe_permute_and_pad_with_probs(
            x, probs, mask, None, 16, num_out_tokens=w.shape[0],
            quantize=qmoe.Blockwise(fp8_dtype=torch.float8_e5m2))
        return out.detach(), out.dequantize() * w, pp * pp, rid, target

    def run(fn):
        x, probs = x0.clone().requires_grad_(), p0.clone().requires_grad_()
        out, z, pp2, rid, target = fn(x, probs)
        (z.sum() + pp2.sum()).backward()
        return out, z, pp2, rid, target, x.grad, probs.grad

    torch._dynamo.reset()
    got, want = run(torch.compile(f, fullgraph=True)), run(f)
    assert_same_quantized(got[0], want[0])
    for a, b in zip(got[1:], want[1:]):
        assert_same_bits(a, b)


def test_bad_quantize_arguments():
    x = torch.randn(4, 32)
    mask = torch.ones(4, 2, dtype=torch.bool)
    with pytest.raises(TypeError, match="inp is already quantized"):
        qmoe.moe_permute(qmoe.quantize(x, qmoe.MXFP8()), mask, 8, quantize=qmoe.MXFP8())
    with pytest.raises(TypeError, match="quantize must be"):
        qmoe.moe_permute(x, mask, 8, quantize="mxfp8")
    with pytest.raises(ValueError, match="quantize_scale is only accepted"):
        qmoe.moe_permute(x, mask, 8, quantize=qmoe.MXFP8(), quantize_scale=torch.tensor(1.0))

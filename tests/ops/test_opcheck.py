"""torch.library.opcheck for every qmoe:: op (schema, fake vs real, autograd
registration), empty inputs included, and fake outputs equal to the real ones."""

import pytest
import torch

import qmoe  # noqa: F401  (registers the ops)
from tests.ops.helpers import routing

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ops = torch.ops.qmoe


def _cases():
    for t, h, e, k in [(13, 24, 4, 2), (0, 8, 4, 2), (5, 1, 7, 7)]:
        ids, mask = routing(t, e, k, "sentinels", DEV)
        x = torch.randn(t, h, device=DEV, requires_grad=True)
        probs = torch.rand(t, e, device=DEV, requires_grad=True)
        n = int(mask.sum()) + 2
        rid_m, fill_m = ops.make_row_id_map(mask, n, False, 1)
        rid_i, fill_i = ops.make_row_id_map(ids, n, True, 1)
        rid_p, fill_p = ops.make_row_id_map(mask, n + 8, False, 4)
        y = torch.randn(n, h, device=DEV, requires_grad=True)
        yield f"make_map_mask-{t}", ops.make_row_id_map.default, (mask, n, False, 1)
        yield f"make_map_pad-{t}", ops.make_row_id_map.default, (mask, n + 8, False, 4)
        yield f"make_map_index-{t}", ops.make_row_id_map.default, (ids, n, True, 1)
        yield f"permute-{t}", ops.permute.default, (x, rid_m, None, n)
        yield f"permute_probs-{t}", ops.permute.default, (x, rid_m, probs, n)
        pk = torch.rand(t, ids.shape[1], device=DEV, requires_grad=True)
        yield f"permute_index_probs-{t}", ops.permute.default, (x, rid_i, pk, n)
        yield f"permute_fill-{t}", ops.permute.default, (x, rid_m, probs, n, fill_m)
        yield f"permute_index_fill-{t}", ops.permute.default, (x, rid_i, pk, n, fill_i)
        yield f"permute_pad_fill-{t}", ops.permute.default, (x, rid_p, probs, n + 8, fill_p)
        side = torch.randn(t, 3, device=DEV)
        yield f"permute_mask-{t}", ops.permute_mask.default, (x, mask, None, None, n, 1)
        yield (f"permute_mask_probs_side-{t}", ops.permute_mask.default,
               (x, mask.to(torch.int32), probs, side, n + 8, 4))
        yield f"unpermute-{t}", ops.unpermute.default, (y, rid_m, None)
        yield f"map_check-{t}", ops.map_check.default, (rid_m, n, probs.detach())
        gpp = torch.randn(n, device=DEV, requires_grad=True)
        yield (f"permute_backward-{t}", ops.permute_backward.default,
               (y, rid_m, gpp, e, torch.float32))
        yield (f"permute_backward_index_bf16-{t}", ops.permute_backward.default,
               (y, rid_i, gpp, ids.shape[1], torch.bfloat16))
        yield f"map_check_bad-{t}", ops.map_check.default, (rid_m, 0, None)
        yield f"unpermute_probs-{t}", ops.unpermute.default, (y, rid_m, probs)
        # fp64 router probs (Megatron's moe_router_dtype="fp64")
        p64 = probs.detach().double().requires_grad_()
        yield f"permute_probs_fp64-{t}", ops.permute.default, (x, rid_m, p64, n)
        yield (f"permute_mask_probs_fp64-{t}", ops.permute_mask.default,
               (x, mask, p64, None, n, 1))
        yield f"unpermute_probs_fp64-{t}", ops.unpermute.default, (y, rid_m, p64)
        g = torch.randn(t, h, device=DEV)
        # The merge's backward, itself differentiable (double backward through the merge).
        gr, yr = g.clone().requires_grad_(), y.detach().clone().requires_grad_()
        yield f"unpermute_bwd-{t}", ops.unpermute_backward.default, (gr, rid_m, probs, yr, n)
        yield (f"unpermute_bwd_unweighted-{t}", ops.unpermute_backward.default,
               (gr, rid_m, None, None, n))
        yield (f"unpermute_bwd_no_grad-{t}", ops.unpermute_backward.default,
               (g, rid_m, probs.detach(), y.detach(), n))
        for name in ("pertensor-e4m3", "blockwise-e5m2", "mx-e4m3"):
            from qmoe.ops.fp8 import bits_of, scale_layout
            from tests.tensors.helpers import RECIPES

            q = qmoe.quantize(y.detach(), RECIPES[name])
            fargs = (bits_of(q), q.raw_scale, rid_m, probs.detach(), scale_layout(q),
                     q.block_size or 0, q.fp8_dtype, torch.bfloat16)
            yield f"unpermute_fp8_{name}-{t}", ops.unpermute_fp8.default, fargs
            if q.block_size is not None:
                xq = qmoe.quantize(x.detach(), RECIPES[name])
                for pr in (None, probs.detach()):
                    yield (f"permute_with_scales_{name}-{pr is None}-{t}",
                           ops.permute_with_scales.default,
                           (bits_of(xq), xq.raw_scale, rid_m, pr, n))
                yield (f"permute_with_scales_fill_{name}-{t}", ops.permute_with_scales.default,
                       (bits_of(xq), xq.raw_scale, rid_p, probs.detach(), n + 8, fill_p))
        # The fused quantize-permute ops: inputs without requires_grad (opcheck's backward
        # test sums every output, and fp8 has no sum; their autograd: test_quantize_permute)
        xd, pd, e4, e5 = x.detach(), probs.detach(), torch.float8_e4m3fn, torch.float8_e5m2
        yield (f"quantize_permute_mx_fill-{t}", ops.quantize_permute.default,
               (xd, rid_m, pd, n, 32, e4, "mx_floor", None, fill_m))
        yield (f"quantize_permute_index_given-{t}", ops.quantize_permute.default,
               (xd, rid_i, None, n, 0, e5, "given", torch.tensor(0.05, device=DEV)))
        yield (f"quantize_permute_mask_pad-{t}", ops.quantize_permute_mask.default,
               (xd, mask, pd, n + 8, 4, 128, e4, "amax", None))
        sizes = torch.tensor([t // 2, 0, t - t // 2], device=DEV)
        order = torch.tensor([2, 0, 1], device=DEV)
        p1 = torch.rand(t, device=DEV, requires_grad=True)
        yield f"sort_chunks-{t}", ops.sort_chunks.default, (x, sizes, order, None)
        # a column-major inp: the fake's outputs must be contiguous, as the real ones
        xt = x.detach().t().contiguous().t().requires_grad_()
        yield f"sort_chunks_colmajor-{t}", ops.sort_chunks.default, (xt, sizes, order, p1)
        yield f"per_tensor_scale-{t}", ops.per_tensor_scale.default, (x.detach(), 448.0, False)
        yield f"sort_chunks_probs-{t}", ops.sort_chunks.default, (x, sizes, order, p1)
        yield (f"sort_chunks_probs_fp64-{t}", ops.sort_chunks.default,
               (x, sizes, order, p1.detach().double().requires_grad_()))
        g1 = torch.randn(t, device=DEV, requires_grad=True)
        yield (f"sort_chunks_bwd-{t}", ops.sort_chunks_backward.default,
               (torch.randn(t, h, device=DEV, requires_grad=True), sizes, order, g1))
        yield (f"sort_chunks_bwd_noprobs-{t}", ops.sort_chunks_backward.default,
               (torch.randn(t, h, device=DEV), sizes, order, None))
        # The expert FFN's ops (differentiable through autograd.Functions above them:
        # inputs without requires_grad)
        hh = torch.randn(t, 2 * h, device=DEV).bfloat16()
        yield f"swiglu-{t}", ops.swiglu.default, (hh,)
        yield f"swiglu_fp32-{t}", ops.swiglu.default, (hh.float(),)
        yield (f"swiglu_backward_fp32-{t}", ops.swiglu_backward.default,
               (torch.randn(t, h, device=DEV), hh.float()))
        yield (f"swiglu_quantize-{t}", ops.swiglu_quantize.default,
               (hh, 32, torch.float8_e4m3fn, "mx_floor"))
        yield (f"swiglu_backward-{t}", ops.swiglu_backward.default,
               (torch.randn(t, h, device=DEV).bfloat16(), hh))
        yield (f"quantize_cols-{t}", ops.quantize_cols.default,
               (torch.randn(3, t, h, device=DEV).bfloat16(),))
        yield (f"zero_tail_-{t}", ops.zero_tail_.default,
               (torch.randn(t + 3, h, device=DEV), torch.tensor([t // 2, t], dtype=torch.int32,
                                                               device=DEV)))
        qd = qmoe.quantize(x.detach(), qmoe.Blockwise(block_size=16))
        yield (f"dequantize_blocks-{t}", ops.dequantize_blocks.default,
               (qd.qdata.view(torch.uint8), qd.fp8_dtype, qd.scale_fp32(), 16, torch.float32))
        # Called below autograd by the quantized types' rule: inputs without requires_grad.
        bits = torch.randint(0, 256, (t, h), dtype=torch.uint8, device=DEV)
        for side in (torch.rand(t, 3, device=DEV), bits[:, :2].clone()):
            for pr in (None, p1.detach()):
                yield (f"sort_chunks_rows-{side.dtype}-{pr is None}-{t}",
                       ops.sort_chunks_rows.default, (bits, side, sizes, order, pr))


# Case names only: each test draws its own inputs (``_case``) after the seed fixture has
# seeded torch, so QMOE_SEED replays them.
NAMES = [c[0] for c in _cases()]


def _case(name):
    """``(op, args)`` of the case ``name``, drawn now (the cases before it too, so the
    draws follow the seed in the same order every run)."""
    return next((op, args) for n, op, args in _cases() if n == name)


@pytest.mark.parametrize("name", NAMES)
def test_opcheck(name):
    op, args = _case(name)
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("name", NAMES)
def test_fake_matches_real(name):
    from torch._subclasses.fake_tensor import FakeTensorMode

    op, args = _case(name)
    real = op(*args)
    mode = FakeTensorMode()
    fargs = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    with mode:
        fake = op(*fargs)
    if real is None:  # an op that writes into its arguments (zero_tail_)
        assert fake is None
        real, fake = tuple(args), tuple(fargs)
    real = real if isinstance(real, tuple) else (real,)
    fake = fake if isinstance(fake, tuple) else (fake,)
    assert len(real) == len(fake)
    for r, f in zip(real, fake):
        if r is None or f is None:  # an optional output the call does not produce
            assert r is None and f is None
            continue
        assert (tuple(r.shape), r.dtype, r.device) == (tuple(f.shape), f.dtype, f.device)

"""Quantized inputs through every op: the type is kept, qdata and scale rows move
bit-exactly, nothing is dequantized on the way, merges return high precision."""

import pytest
import torch

import qmoe
from qmoe.ops import reference as R
from tests.ops.helpers import assert_bf16_merge, last_routed_row, routing
from tests.tensors.helpers import RECIPES, assert_same_bits, skip_wide_rowwise, tiny_mx_blocks

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FP8_RECIPES = {k: v for k, v in RECIPES.items() if "pow2" not in k}


def _ref_rows(t: torch.Tensor, rm, map_type, n=None, align=1):
    """Reference permutation of raw rows (bits for fp8 / e8m0, values for fp32 scales)."""
    raw = t.view(torch.uint8) if t.element_size() == 1 else t
    out, _, _ = R.permute(raw.cpu(), rm.cpu(), map_type, n, align_size=align)
    return out


def _check_moved(out, q, rm, map_type, n=None, align=1):
    assert type(out) is type(q) and out._attrs() == q._attrs() and out.fp8_dtype == q.fp8_dtype
    assert_same_bits(out.qdata.view(torch.uint8).cpu(), _ref_rows(q.qdata, rm, map_type, n, align))
    if q.block_size is None:
        assert torch.equal(out.scale, q.scale)
    else:
        assert_same_bits(out.raw_scale.cpu(), _ref_rows(q.raw_scale, rm, map_type, n, align))


@pytest.mark.parametrize("name", list(FP8_RECIPES))
@pytest.mark.parametrize("map_type", ["mask", "index"])
@pytest.mark.parametrize("t,h,e,k,kind,extra", [
    (63, 129, 8, 3, "sentinels", 0), (37, 300, 8, 3, "sentinels", -9),
    (5, 17, 8, 3, "sentinels", 4), (1, 7168, 256, 8, "random", 0),
    (1025, 1, 4, 4, "random", 3), (40, 64, 1024, 1, "one_expert", -5),
])
def test_permute_moves_qdata_and_scales(name, map_type, t, h, e, k, kind, extra):
    skip_wide_rowwise(FP8_RECIPES[name], h)
    ids, mask = routing(t, e, k, kind, DEV)
    rm = mask if map_type == "mask" else ids
    q = qmoe.quantize(torch.randn(t, h, dtype=torch.bfloat16, device=DEV), FP8_RECIPES[name])
    n = max(0, int(mask.sum()) + extra)
    probs = torch.rand(t, rm.shape[1], device=DEV)
    with qmoe.strict_dispatch():  # would raise on any dequantizing fallback
        out, rid = qmoe.moe_permute(q, rm, n, map_type=map_type)
        out2, pp, _ = qmoe.moe_permute_with_probs(q, probs, rm, n, map_type=map_type)
    _check_moved(out, q, rm, map_type, n)
    _check_moved(out2, q, rm, map_type, n)
    _, rpp, _ = R.permute(torch.zeros(t, 1), rm.cpu(), map_type, n, probs.cpu())
    assert_same_bits(pp.cpu(), rpp)  # the probs move with the quantized rows
    # Unpermute of the quantized rows: high precision, against fp64 of the dequantized rows.
    w = torch.rand(t, rm.shape[1], device=DEV)
    y = qmoe.moe_unpermute(out, rid, w, map_type=map_type)
    assert type(y) is torch.Tensor and y.dtype == torch.bfloat16
    assert_bf16_merge(y, out.dequantize(torch.float32), rm, map_type, w, n)


@pytest.mark.parametrize("name", list(FP8_RECIPES))
def test_pad_variant_zero_padding(name):
    t, h, e = 45, 160, 8
    ids, mask = routing(t, e, 2, "empty_experts", DEV)
    q = qmoe.quantize(torch.randn(t, h, device=DEV), FP8_RECIPES[name])
    probs = torch.rand(t, e, device=DEV)
    padded = int(((mask.sum(0) + 15) // 16 * 16).sum())
    drop = last_routed_row(mask, 16) - 2  # drops the last expert's last routes
    for bound in (None, padded + 7, drop):  # both forms: spare rows, dropped routes
        with qmoe.strict_dispatch():
            out, pp, rid, po, target = qmoe.moe_permute_and_pad_with_probs(
                q, probs, mask, None, 16, num_out_tokens=bound)
        _check_moved(out, q, mask, "mask", n=bound, align=16)
        real = torch.zeros(out.shape[0], dtype=torch.bool)
        s = (rid.shape[1] - 1) // 2
        for tok in range(t):
            for j in range(int(rid[tok, 2 * s])):
                real[int(rid[tok, j])] = True
        deq = out.dequantize(torch.float32).cpu()
        assert torch.equal(deq[~real], torch.zeros_like(deq[~real]))  # pads: exact zeros
        if bound == drop:
            assert int(rid[:, 2 * s].sum()) < int(mask.sum())  # routes were dropped


@pytest.mark.parametrize("name", list(FP8_RECIPES))
def test_sort_chunks_quantized(name):
    t, h = 50, 96
    q = qmoe.quantize(torch.randn(t, h, device=DEV), FP8_RECIPES[name])
    sizes = torch.tensor([7, 0, 20, 13], device=DEV)
    order = torch.tensor([2, 3, 0, 1], device=DEV)
    probs = torch.rand(t, device=DEV)
    with qmoe.strict_dispatch():
        out, pp = qmoe.moe_sort_chunks_by_index_with_probs(q, probs, sizes, order)
    assert type(out) is type(q)
    ref_q, rpp = R.sort_chunks(q.qdata.view(torch.uint8).cpu(), sizes.tolist(), order.tolist(),
                               probs.cpu())
    assert_same_bits(out.qdata.view(torch.uint8).cpu(), ref_q)
    assert_same_bits(pp.cpu(), rpp)
    if q.block_size is not None:
        ref_s, _ = R.sort_chunks(q.raw_scale.cpu(), sizes.tolist(), order.tolist())
        assert_same_bits(out.raw_scale.cpu(), ref_s)


@pytest.mark.parametrize("name", list(FP8_RECIPES))
@pytest.mark.parametrize("map_type", ["mask", "index"])
def test_autograd_reaches_x_in_high_precision(name, map_type):
    t, h, e, k = 40, 64, 8, 2
    ids, mask = routing(t, e, k, "sentinels", DEV)
    rm = mask if map_type == "mask" else ids
    w = torch.rand(t, rm.shape[1], device=DEV)
    x = torch.randn(t, h, dtype=torch.bfloat16, device=DEV)
    g = torch.randn(t, h, dtype=torch.bfloat16, device=DEV)

    def run(quantized):
        xx = x.clone().requires_grad_()
        inp = qmoe.quantize(xx, FP8_RECIPES[name]) if quantized else xx
        out, rid = qmoe.moe_permute(inp, rm, t * k, map_type=map_type)
        work = out.dequantize() * 2 if quantized else out * 2
        qmoe.moe_unpermute(work, rid, w, map_type=map_type).backward(g)
        return xx.grad

    gq, gp = run(True), run(False)
    assert gq.dtype == torch.bfloat16 and type(gq) is torch.Tensor
    assert torch.equal(gq, gp)  # a permutation's gradient does not depend on the values


def test_quantized_probs_rejected():
    x = torch.randn(6, 32)
    mask = torch.zeros(6, 4, dtype=torch.bool)
    mask[:, 1] = True
    pq = qmoe.quantize(torch.rand(6, 4), qmoe.PerTensor())
    with pytest.raises(TypeError, match="only inp may be quantized"):
        qmoe.moe_permute_with_probs(x, pq, mask)


@pytest.mark.parametrize("name", ["blockwise-e4m3", "mx-e5m2", "pertensor-e4m3"])
def test_unpermute_of_quantized_rows_backward(name):
    t, h, e = 30, 64, 6
    ids, mask = routing(t, e, 2, "random", DEV)
    x = torch.randn(t, h, device=DEV, requires_grad=True)
    w = torch.rand(t, e, device=DEV, requires_grad=True)
    q = qmoe.quantize(x, FP8_RECIPES[name])
    out, rid = qmoe.moe_permute(q, mask, t * 2)
    with qmoe.strict_dispatch():
        y = qmoe.moe_unpermute(out, rid, w)
        g = torch.randn_like(y)
        y.backward(g)
    deq = out.dequantize(torch.float32).detach()
    yd = deq.requires_grad_()
    wd = w.detach().clone().requires_grad_()
    qmoe.moe_unpermute(yd, rid, wd).backward(g)
    torch.testing.assert_close(w.grad, wd.grad, rtol=1e-5, atol=1e-5)
    # x's gradient: quantize passes it straight through, so it is the plain path's (the
    # merge's backward scatters g * w, which does not read the rows)
    xe = x.detach().clone().requires_grad_()
    out_e, rid_e = qmoe.moe_permute(xe, mask, t * 2)
    qmoe.moe_unpermute(out_e, rid_e, w.detach()).backward(g)
    assert x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, xe.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("path", ["op", "torch", "triton"])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_mx_merge_of_tiny_blocks(request, path, fp8):
    """The FP8 merge of MX rows whose blocks lie below the OCP exponent -126 (byte 1) or
    are all zero (byte 0, read as 2**-127): each token's two halves add up to it exactly.
    ``op``: ``moe_unpermute`` on this machine's path (CPU: the C++ kernels when built);
    ``torch`` / ``triton``: the merge launcher on the torch path (the CPU fallback: CPU
    tensors) / the Triton kernel."""
    from qmoe.ops import torch_impl as TI
    from qmoe.ops.fp8 import bits_of, scale_layout
    from qmoe.ops.kernels import unpermute as KU

    dev = {"triton": request.getfixturevalue("kdevice"), "torch": "cpu"}.get(path, DEV)
    x, _ = tiny_mx_blocks(fp8)
    t = x.shape[0]
    _, mask = routing(t, 4, 2, "random", dev)
    half = torch.where(mask, 0.5, 0.0)

    def merge(q, rid):
        if path == "op":
            return qmoe.moe_unpermute(q, rid, half)
        fn = KU.unpermute_fp8_triton if path == "triton" else TI.unpermute_fp8_rows
        return fn(bits_of(q), q.raw_scale, scale_layout(q), 32, fp8, rid, half, torch.float32)

    out, rid = qmoe.moe_permute(qmoe.quantize(x.to(dev), qmoe.MXFP8(fp8)), mask, 2 * t)
    assert torch.equal(merge(out, rid).cpu(), x)
    # byte 0 is 2**-127 (not zero) where it scales nonzero elements, as OCP MX defines it
    q0 = qmoe.MXFP8Tensor(torch.full((t, 32), 128.0, device=dev).to(fp8),
                          torch.zeros(t, 1, dtype=torch.uint8, device=dev), torch.float32)
    out, rid = qmoe.moe_permute(q0, mask, 2 * t)
    assert torch.equal(merge(out, rid).cpu(), torch.full((t, 32), 2.0**-120))

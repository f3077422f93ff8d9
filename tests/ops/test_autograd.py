"""Gradients of every op, against autograd through the reference-built dense path."""

import pytest
import torch

import qmoe
from tests.ops.helpers import last_routed_row, reference_routes, routing

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _perm_matrix(routes, n: int, t: int) -> torch.Tensor:
    """Dense [N, T] 0/1 matrix of the permutation of ``routes`` (``reference_routes``)."""
    m = torch.zeros(n, t, dtype=torch.float64)
    rows, toks, _ = routes
    m[rows, toks] = 1.0
    return m


def _work(out, pp):
    """The "expert" work between permute and unpermute: touches both outputs, and every
    row (padding rows too: the merge must never read them)."""
    return out * 2.0 + pp[:, None] + 1.0


def _check_against_dense(routes, n, x, probs, merge, g):
    """Gradients of ``unpermute(_work(permute_with_probs(x, probs)), merge)`` against the
    same function built densely in fp64 from the reference's permutation matrix
    (``routes``: ``reference_routes``)."""
    t = x.shape[0]
    pm = _perm_matrix(routes, n, t)
    xd = x.detach().cpu().double().requires_grad_()
    pd = probs.detach().cpu().double().requires_grad_()
    md = merge.detach().cpu().double().requires_grad_()
    col_of_row = torch.full((n,), 0, dtype=torch.long)
    rows, _, cols = routes
    col_of_row[rows] = cols
    rows_tok = pm.argmax(1)
    ppd = (pm @ torch.ones(t, dtype=torch.float64)) * pd[rows_tok, col_of_row]
    w_of_row = pm * md[rows_tok, col_of_row][:, None]
    yd = w_of_row.T @ _work(pm @ xd, ppd)
    (yd * g.cpu().double()).sum().backward()
    torch.testing.assert_close(x.grad.cpu().double(), xd.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(probs.grad.cpu().double(), pd.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merge.grad.cpu().double(), md.grad, rtol=1e-5, atol=1e-5)


def _leaves(t, h, cols):
    x = torch.randn(t, h, device=DEV, requires_grad=True)
    probs = torch.rand(t, cols, device=DEV, requires_grad=True)
    merge = torch.rand(t, cols, device=DEV, requires_grad=True)
    return x, probs, merge


@pytest.mark.parametrize("map_type", ["mask", "index"])
@pytest.mark.parametrize("extra", [-5, 0, 3])
def test_permute_probs_unpermute_backward(map_type, extra):
    t, h, e, k = 31, 24, 6, 2
    ids, mask = routing(t, e, k, "sentinels", DEV)
    rm = mask if map_type == "mask" else ids
    n = max(0, int(mask.sum()) + extra)
    x, probs, merge = _leaves(t, h, rm.shape[1])
    out, pp, rid = qmoe.moe_permute_with_probs(x, probs, rm, n, map_type=map_type)
    y = qmoe.moe_unpermute(_work(out, pp), rid, merge, map_type=map_type)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    _check_against_dense(reference_routes(rm, map_type, n), n, x, probs, merge, g)


@pytest.mark.parametrize("align", [4, 16])
@pytest.mark.parametrize("spare", [None, 9, -7, "drop"])
def test_pad_variant_backward(align, spare):
    """The pad variant in both forms (host-synced N, or a bound with spare rows or dropped
    ones): gradients reach x and probs through the permutation alone; padding and spare
    rows (which the work fills with ones) take no part."""
    t, h, e, k = 29, 16, 6, 2
    _, mask = routing(t, e, k, "empty_experts", DEV)
    x, probs, merge = _leaves(t, h, e)
    padded = int(((mask.sum(0) + align - 1) // align * align).sum())
    # -7 may cut padding only; "drop" cuts the last expert's last routes for sure
    bound = (None if spare is None else last_routed_row(mask, align) - 2 if spare == "drop"
             else padded + spare)
    out, pp, rid, pad_offsets, _ = qmoe.moe_permute_and_pad_with_probs(
        x, probs, mask, None, align, num_out_tokens=bound)
    assert out.shape[0] == (padded if bound is None else bound)
    if spare == "drop":
        assert int(rid[:, -1].sum()) < int(mask.sum())
    y = qmoe.moe_unpermute(_work(out, pp), rid, merge, pad_offsets=pad_offsets)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    n = out.shape[0]
    _check_against_dense(reference_routes(mask, "mask", n, align), n, x, probs, merge, g)


@pytest.mark.parametrize("probs_dtype", [torch.float32, torch.float64])
def test_sort_chunks_backward(probs_dtype):
    t, h = 40, 8
    x = torch.randn(t, h, device=DEV, requires_grad=True)
    p = torch.rand(t, device=DEV, dtype=probs_dtype, requires_grad=True)
    sizes = torch.tensor([5, 0, 12, 3, 10], device=DEV)  # 30 of 40 rows; the rest stay
    order = torch.tensor([3, 0, 4, 1, 2], device=DEV)
    out, pp = qmoe.moe_sort_chunks_by_index_with_probs(x, p, sizes, order)
    g, gp = torch.randn_like(out), torch.randn_like(pp)
    ((out * g).sum() + (pp * gp).sum()).backward()
    # The chunk sort is a permutation: the gradient is the inverse permutation.
    src = list(range(t))
    starts = [0, 5, 5, 17, 20]
    rows = []
    for c in order.tolist():
        rows += list(range(starts[c], starts[c] + sizes[c].item()))
    src[: len(rows)] = rows
    src = torch.tensor(src, device=DEV)
    want_g = torch.zeros_like(g).index_copy_(0, src, g)
    assert torch.equal(out, x.detach()[src]) and torch.equal(pp, p.detach()[src])
    assert torch.equal(x.grad, want_g)
    assert torch.equal(p.grad, torch.zeros_like(gp).index_copy_(0, src, gp))


def test_unpermute_probs_grad_without_input_grad():
    # merging_probs gets its gradient even when inp needs none (a TE pitfall).
    t, e = 16, 4
    ids, mask = routing(t, e, 2, "random", DEV)
    x = torch.randn(t, 8, device=DEV)
    out, rid = qmoe.moe_permute(x, mask)
    w = torch.rand(t, e, device=DEV, requires_grad=True)
    qmoe.moe_unpermute(out, rid, w).sum().backward()
    assert w.grad is not None and w.grad.abs().sum() > 0
    assert torch.equal(w.grad[~mask], torch.zeros_like(w.grad[~mask]))


def test_sort_chunks_double_backward():
    """The backward (``qmoe::sort_chunks_backward``, the inverse movement) is itself
    differentiable: its gradient is the forward sort, bit for bit."""
    t, h = 40, 8
    x = torch.randn(t, h, device=DEV, requires_grad=True)
    p = torch.rand(t, device=DEV, requires_grad=True)
    sizes = torch.tensor([5, 0, 12, 3, 10], device=DEV)
    order = torch.tensor([3, 0, 4, 1, 2], device=DEV)
    out, pp = qmoe.moe_sort_chunks_by_index_with_probs(x, p, sizes, order)
    g = torch.randn_like(out, requires_grad=True)
    gq = torch.randn_like(pp, requires_grad=True)
    gx, gp = torch.autograd.grad((out, pp), (x, p), (g, gq), create_graph=True)
    u, v = torch.randn_like(gx), torch.randn_like(gp)
    dg, dgq = torch.autograd.grad(((gx * u).sum(), (gp * v).sum()), (g, gq))
    want, want_p = qmoe.moe_sort_chunks_by_index_with_probs(u, v, sizes, order)
    assert torch.equal(dg, want) and torch.equal(dgq, want_p)


@pytest.mark.parametrize("map_type", ["mask", "index"])
@pytest.mark.parametrize("weighted", [True, False])
def test_unpermute_double_backward(map_type, weighted):
    """Second-order gradients through the merge (gradient penalties, Hessian-vector
    products) against the same merge written densely in fp64 with index_add."""
    t, h, e, k = 13, 7, 5, 2
    ids, mask = routing(t, e, k, "sentinels", DEV)
    rm = mask if map_type == "mask" else ids
    _, rid = qmoe.moe_permute(torch.randn(t, 1, device=DEV), rm, map_type=map_type)
    n = int(mask.sum())
    y = torch.randn(n, h, device=DEV, requires_grad=True)
    w = torch.rand(t, rm.shape[1], device=DEV, requires_grad=True) if weighted else None
    a, b = torch.randn(t, h, device=DEV), torch.randn(n, h, device=DEV)
    c = torch.randn(t, rm.shape[1], device=DEV)

    def second_order(merge, y, w):
        u = merge(y, w)
        leaves = [y] + ([w] if w is not None else [])
        firsts = torch.autograd.grad((u * a).square().sum(), leaves, create_graph=True)
        loss2 = (firsts[0] * b).sum() + (firsts[1] * c).sum() if w is not None else (
            (firsts[0] * b).sum())
        return torch.autograd.grad(loss2, leaves)

    got = second_order(lambda y, w: qmoe.moe_unpermute(y, rid, w, map_type=map_type), y, w)
    rows, toks, cols = reference_routes(rm, map_type, n)

    def dense(y, w):
        rows_w = y[rows] if w is None else y[rows] * w[toks, cols][:, None]
        return torch.zeros(t, h, dtype=torch.float64).index_add(0, toks, rows_w)

    a, b, c = a.cpu().double(), b.cpu().double(), c.cpu().double()
    yd = y.detach().cpu().double().requires_grad_()
    wd = None if w is None else w.detach().cpu().double().requires_grad_()
    want = second_order(dense, yd, wd)
    assert len(got) == len(want)
    for g, wnt in zip(got, want):
        torch.testing.assert_close(g.cpu().double(), wnt, rtol=1e-5, atol=1e-5)


def test_unpermute_double_backward_passes_nan_through():
    """A NaN in the upstream gradient of the merge weights' gradient (an overflowing scaled
    loss under a gradient scaler) comes out as NaN, as in plain torch: the double backward
    does not hand it to the merge kernels as weights (which refuse NaN weights with a
    device assert on CUDA)."""
    t, h, e, k = 6, 8, 4, 2
    _, mask = routing(t, e, k, "random", DEV)
    _, rid = qmoe.moe_permute(torch.randn(t, 1, device=DEV), mask)
    y = torch.randn(int(mask.sum()), h, device=DEV, requires_grad=True)
    w = torch.rand(t, e, device=DEV, requires_grad=True)
    u = qmoe.moe_unpermute(y, rid, w)
    gy, gw = torch.autograd.grad(u.square().sum(), [y, w], create_graph=True)
    c = torch.ones(t, e, device=DEV)
    c[0] = float("nan")
    hy, hw = torch.autograd.grad((gw * c).sum(), [y, w])
    token0_rows = rid[0, : int(rid[0, -1])].long()
    assert hy[token0_rows].isnan().all() and not hy[~torch.isin(
        torch.arange(hy.shape[0], device=DEV), token0_rows)].isnan().any()
    assert hw[0].isnan().any() and not hw[1:].isnan().any()


@pytest.mark.parametrize("map_type", ["mask", "index"])
def test_permute_with_probs_double_backward(map_type):
    """Second-order gradients through a permute with probs (its backward is one
    ``qmoe::permute_backward``, itself differentiable): the first-order gradients taken
    with create_graph, then differentiated with respect to the upstream gradients, give
    the permute of the new upstream rows and probs (the backward is linear in them)."""
    t, h, e, k = 13, 7, 5, 2
    ids, mask = routing(t, e, k, "sentinels", DEV)
    rm = mask if map_type == "mask" else ids
    n = int(mask.sum()) + 2
    x = torch.randn(t, h, device=DEV, requires_grad=True)
    p = torch.rand(t, rm.shape[1], device=DEV, requires_grad=True)
    out, pp, rid = qmoe.moe_permute_with_probs(x, p, rm, num_out_tokens=n, map_type=map_type)
    g = torch.randn_like(out, requires_grad=True)
    gq = torch.randn_like(pp, requires_grad=True)
    gx, gp = torch.autograd.grad((out, pp), (x, p), (g, gq), create_graph=True)
    u, v = torch.randn_like(gx), torch.randn_like(gp)
    dg, dgq = torch.autograd.grad(((gx * u).sum(), (gp * v).sum()), (g, gq))
    want, want_p, _ = qmoe.moe_permute_with_probs(u, v, rm, num_out_tokens=n,
                                                  map_type=map_type)
    assert torch.equal(dg, want) and torch.equal(dgq, want_p)


@pytest.mark.parametrize("map_type", ["mask", "index"])
def test_permute_gradients_with_an_output_unused(map_type):
    """Only the rows, or only the permuted probs, reach the loss (autograd passes None for
    the other: no zero-filled gradient is made): each input's gradient is what the full
    loss gives for its part, the unused side's gradient absent or zero."""
    t, h, e, k = 13, 7, 5, 2
    ids, mask = routing(t, e, k, "sentinels", DEV)
    rm = mask if map_type == "mask" else ids
    n = int(mask.sum())
    x = torch.randn(t, h, device=DEV, requires_grad=True)
    p = torch.rand(t, rm.shape[1], device=DEV, requires_grad=True)
    w_rows = torch.randn(n, h, device=DEV)
    w_pp = torch.randn(n, device=DEV)
    out, pp, _ = qmoe.moe_permute_with_probs(x, p, rm, num_out_tokens=n, map_type=map_type)
    gx_full, gp_full = torch.autograd.grad((out * w_rows).sum() + (pp * w_pp).sum(), (x, p))
    for use_rows in (True, False):
        out, pp, _ = qmoe.moe_permute_with_probs(x, p, rm, num_out_tokens=n,
                                                 map_type=map_type)
        loss = (out * w_rows).sum() if use_rows else (pp * w_pp).sum()
        gx, gp = torch.autograd.grad(loss, (x, p), allow_unused=True)
        if use_rows:
            assert torch.equal(gx, gx_full) and (gp is None or (gp == 0).all())
        else:
            assert torch.equal(gp, gp_full) and (gx is None or (gx == 0).all())

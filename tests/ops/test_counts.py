"""``qmoe.ops.counts``: per-expert counts and grouped-GEMM offsets of a permuted output.

The counts are checked three ways: against a row-by-row simulation of the layout from the
reference routes (``qmoe.ops.reference``), against where ``qmoe.moe_permute*`` really
wrote each expert's rows (tagged probs: ``probs[t, col] = expert + 1``), and end to end
through a grouped GEMM, whose merged output must equal a per-route fp64 reference.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import qmoe
from qmoe.ops import reference as R
from qmoe.ops.counts import expert_offsets, tokens_per_expert

# (T, E, K): T = 1, 63, 1025; E = 1, 8, 64; K = 1, 2, 8
SIZES = [(1, 1, 1), (1, 8, 2), (63, 1, 1), (63, 8, 2), (63, 64, 8), (1025, 8, 1),
         (1025, 64, 8), (1025, 8, 8)]
KINDS = ["random", "empty_experts", "one_expert"]


def make_routing(t: int, e: int, k: int, kind: str):
    """``(ids [T, K] int64, -1 = unused slot; mask [T, E] bool)`` of one routing.

    random: top-k of random scores, a tenth of the tokens routed nowhere; empty_experts:
    only a random third of the experts (at least one) get tokens; one_expert: every token
    to one random expert (K = 1 routes, the other slots -1)."""
    k = min(k, e)
    if kind == "one_expert":
        ids = torch.full((t, k), -1, dtype=torch.long)
        ids[:, 0] = int(torch.randint(e, ()))
    elif kind == "empty_experts":
        live = torch.randperm(e)[: max(1, e // 3)]
        kk = min(k, live.numel())
        ids = torch.full((t, k), -1, dtype=torch.long)
        ids[:, :kk] = live[torch.rand(t, live.numel()).argsort(dim=1)[:, :kk]]
    else:
        ids = torch.rand(t, e).argsort(dim=1)[:, :k]
        ids[torch.rand(t) < 0.1] = -1
    mask = torch.zeros(t, e + 1, dtype=torch.bool).scatter_(1, torch.where(ids >= 0, ids, e),
                                                            True)
    return ids, mask[:, :e].contiguous()


def simulate(routing_map, map_type: str, e: int, n, align: int = 1):
    """Lay the output out row by row, as the permutes define it (expert-major, token-minor,
    each group padded to ``align``, rows ``>= N`` dropped): ``(rows of each expert among
    the N rows, output row of each reference route or -1, N)``."""
    routes = R.routes_of(routing_map, map_type)
    by_expert = [[] for _ in range(e)]
    for i, (_, ex, _) in enumerate(routes):
        by_expert[ex].append(i)
    owner, pos = [], [0] * len(routes)
    for ex in range(e):
        for i in by_expert[ex]:
            pos[i] = len(owner)
            owner.append(ex)
        while len(owner) % align:
            owner.append(ex)
    n = len(owner) if n is None else n
    kept = Counter(owner[:n])
    counts = [kept[ex] for ex in range(e)]
    if align > 1:  # the reference's own padded rows agree with this walk
        assert pos == R.padded_positions(routes, e, align)[0]
    return counts, [p if p < n else -1 for p in pos], n


def bounds(counts: torch.Tensor):
    offs = expert_offsets(counts)
    assert offs.dtype == torch.int32 and offs.shape == counts.shape
    return (offs - counts).tolist(), offs.tolist()


def check_rows_in_blocks(counts, routing_map, map_type, e, n, align=1):
    """Every kept route's row (from the reference) inside its expert's block."""
    want, pos, n_eff = simulate(routing_map, map_type, e, n, align)
    assert counts.dtype == torch.int32 and counts.shape == (e,)
    assert counts.tolist() == want
    lo, hi = bounds(counts)
    for (_, ex, _), p in zip(R.routes_of(routing_map, map_type), pos):
        if p >= 0:
            assert lo[ex] <= p < hi[ex], (ex, p, lo[ex], hi[ex])
    assert (hi[-1] if e else 0) <= n_eff
    return n_eff


def tagged(t: int, e: int, ids, mask, map_type: str, h: int = 4):
    """``(x [T, h], probs)``: x[t, 0] = t + 1; probs[t, col] = expert + 1."""
    x = torch.zeros(t, h)
    x[:, 0] = torch.arange(1, t + 1, dtype=torch.float32)
    if map_type == "mask":
        probs = torch.arange(1, e + 1, dtype=torch.float32).expand(t, e).contiguous()
    else:
        probs = (ids + 1).clamp(min=0).float()
    return x, probs


def check_written_rows(counts, out, pp, mask):
    """Where the permute wrote each route: rows tagged expert ``ex`` lie in its block and
    carry a token that ``mask`` routes to ``ex``; every other row (padding, the tail past
    ``offs[-1]``) is zero. Returns how many rows of each expert the output holds."""
    e = counts.shape[0]
    lo, hi = bounds(counts)
    tag = pp.long() - 1  # the expert of each row, -1 where no route wrote
    tok = out[:, 0].long() - 1
    assert torch.equal(tag >= 0, tok >= 0)
    assert not out[tag < 0].any()
    routes = {(t, ex) for t, ex in mask.nonzero().tolist()}
    for r, (ex, t) in enumerate(zip(tag.tolist(), tok.tolist())):
        if ex >= 0:
            assert lo[ex] <= r < hi[ex], (r, ex, lo[ex], hi[ex])
            assert (t, ex) in routes, (r, t, ex)
    return [int((tag == ex).sum()) for ex in range(e)]


@pytest.mark.parametrize("t,e,k", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_counts_after_drops(t, e, k, kind):
    """Mask and index maps of one routing, for N = all (None), 0, a random cut, one short
    of the routed rows, and spare rows: the counts are the layout's, every kept route's
    row falls in its expert's block, and qmoe's permute writes each expert's rows there."""
    ids, mask = make_routing(t, e, k, kind)
    routed = int(mask.sum())
    ns = {None, 0, int(torch.randint(routed + 1, ())), max(routed - 1, 0), routed + 5}
    for n in sorted(ns, key=lambda v: -1 if v is None else v):
        c_mask = tokens_per_expert(mask, n)
        c_index = tokens_per_expert(ids, n, map_type="index", num_experts=e)
        assert torch.equal(c_mask, c_index), n
        n_eff = check_rows_in_blocks(c_mask, mask, "mask", e, n)
        check_rows_in_blocks(c_index, ids, "index", e, n)
        assert int(c_mask.sum()) == min(routed, n_eff)
        for map_type, rm in (("mask", mask), ("index", ids)):
            x, probs = tagged(t, e, ids, mask, map_type)
            out, pp, _ = qmoe.moe_permute_with_probs(x, probs, rm, n, map_type=map_type,
                                                     num_experts=e if map_type == "index"
                                                     else None)
            assert out.shape[0] == n_eff
            assert check_written_rows(c_mask, out, pp, mask) == c_mask.tolist()


@pytest.mark.parametrize("t,e,k", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_pad_variant_counts(t, e, k, kind):
    """The pad variant (align 16): padded counts whose offsets are each padded block's
    bounds in the real output, for TransformerEngine's form (N = padded total) and the
    sync-free one (N cutting a block's rows, its padding, or nothing; N = 0). The
    variant's own ``target_tokens_per_expert`` matches without drops and overshoots N
    with them, where these counts do not."""
    align = 16
    ids, mask = make_routing(t, e, k, kind)
    _, _, total = simulate(mask, "mask", e, None, align)
    routed = int(mask.sum())
    ns = {None, 0, max(total - 7, 0), int(torch.randint(routed + 1, ())), total + align}
    for n in sorted(ns, key=lambda v: -1 if v is None else v):
        counts = tokens_per_expert(mask, n, align_size=align)
        check_rows_in_blocks(counts, mask, "mask", e, n, align)
        x, probs = tagged(t, e, ids, mask, "mask")
        out, pp, _, _, target = qmoe.moe_permute_and_pad_with_probs(
            x, probs, mask, None, align, num_out_tokens=n)
        n_out = out.shape[0]
        lo, hi = bounds(counts)
        assert hi[-1] == min(total, n_out)
        written = check_written_rows(counts, out, pp, mask)
        real = mask.sum(0).tolist()
        for ex in range(e):
            size = hi[ex] - lo[ex]
            assert size % align == 0 or hi[ex] == n_out, (ex, size)  # only N cuts a block
            assert written[ex] == min(real[ex], size)  # real rows first, then padding
        if n is None:
            assert counts.tolist() == target.tolist()
        elif int(target.sum()) > n_out:  # drops: the variant's own counts overshoot N
            assert int(expert_offsets(target)[-1]) > n_out >= hi[-1]


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int8, torch.int32,
                                   torch.int64])
def test_integer_masks_count_like_bool(dtype):
    ids, mask = make_routing(63, 8, 2, "random")
    for n, align in ((None, 1), (50, 1), (70, 16)):
        want = tokens_per_expert(mask, n, align_size=align)
        assert torch.equal(tokens_per_expert(mask.to(dtype), n, align_size=align), want)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.uint8])
def test_index_id_dtypes(dtype):
    ids, mask = make_routing(63, 8, 2, "random")
    if dtype == torch.uint8:  # no -1 sentinel: every slot routed
        ids = torch.rand(63, 8).argsort(dim=1)[:, :2]
        mask = torch.zeros(63, 8, dtype=torch.bool).scatter_(1, ids, True)
    got = tokens_per_expert(ids.to(dtype), 100, map_type="index", num_experts=8)
    assert torch.equal(got, tokens_per_expert(mask, 100))


def test_hand_computed_layouts():
    """Small layouts worked out by hand. Routes per expert: [3, 1, 2, 0, 2]."""
    mask = torch.tensor([[1, 0, 1, 0, 0],
                         [1, 1, 0, 0, 1],
                         [0, 0, 1, 0, 0],
                         [1, 0, 0, 0, 1]], dtype=torch.bool)
    cases = [
        (None, 1, [3, 1, 2, 0, 2]),
        (8, 1, [3, 1, 2, 0, 2]),
        (5, 1, [3, 1, 1, 0, 0]),  # rows 0-2, 3, then 4: expert 2 cut after one row
        (3, 1, [3, 0, 0, 0, 0]),
        (0, 1, [0, 0, 0, 0, 0]),
        (None, 4, [4, 4, 4, 0, 4]),  # blocks [0,4) [4,8) [8,12) [12,12) [12,16)
        (10, 4, [4, 4, 2, 0, 0]),  # N cuts expert 2's real rows (rows 8, 9 of 8, 9)
        (11, 4, [4, 4, 3, 0, 0]),  # N cuts expert 2's padding (row 10); expert 4 is out
        (13, 4, [4, 4, 4, 0, 1]),  # expert 4 keeps one real row, its second is dropped
        (20, 4, [4, 4, 4, 0, 4]),  # spare rows past the padded total
    ]
    for n, align, want in cases:
        assert tokens_per_expert(mask, n, align_size=align).tolist() == want, (n, align)
    offs = expert_offsets(tokens_per_expert(mask, 13, align_size=4))
    assert offs.tolist() == [4, 8, 12, 12, 13]
    ids = torch.tensor([[2, 0, -1], [4, 1, 0], [-1, 2, -1], [0, 4, -1]])  # the same routing
    got = tokens_per_expert(ids, 6, map_type="index", num_experts=5)
    assert got.tolist() == [3, 1, 2, 0, 0]  # rows 0-2, 3, 4-5


def test_one_expert_takes_all_and_empty():
    t, e = 10, 4
    mask = torch.zeros(t, e, dtype=torch.bool)
    mask[:, 2] = True
    assert tokens_per_expert(mask, 7).tolist() == [0, 0, 7, 0]
    assert tokens_per_expert(mask, None, align_size=16).tolist() == [0, 0, 16, 0]
    assert tokens_per_expert(mask, 12, align_size=16).tolist() == [0, 0, 12, 0]
    ids = torch.full((t, 3), -1)
    ids[:, 1] = 2
    assert tokens_per_expert(ids, 7, map_type="index", num_experts=e).tolist() == [0, 0, 7, 0]
    nothing = torch.zeros(t, e, dtype=torch.bool)  # no token routed anywhere
    assert tokens_per_expert(nothing, None, align_size=16).tolist() == [0] * e
    assert tokens_per_expert(torch.full((t, 2), -1), 5, map_type="index",
                             num_experts=e).tolist() == [0] * e


@pytest.mark.parametrize("align", [1, 16])
def test_no_tokens(align):
    """T = 0: zero counts and offsets, for both maps and every N."""
    for n in (None, 0, 5):
        got = tokens_per_expert(torch.zeros(0, 8, dtype=torch.bool), n, align_size=align)
        assert got.dtype == torch.int32 and got.tolist() == [0] * 8
        assert expert_offsets(got).tolist() == [0] * 8
        if align == 1:
            got = tokens_per_expert(torch.zeros(0, 2, dtype=torch.long), n, map_type="index",
                                    num_experts=8)
            assert got.tolist() == [0] * 8
    assert expert_offsets(torch.zeros(0, dtype=torch.int64)).shape == (0,)


def test_tensor_num_out_tokens():
    """A 0-d tensor N is read on the device (``tokens_per_expert.sum()``, as
    TransformerEngine's callers pass); -1 there means all routed rows."""
    ids, mask = make_routing(63, 8, 2, "random")
    for n in (0, 37, 200):
        for dtype in (torch.int32, torch.int64):
            for align in (1, 16):
                assert torch.equal(tokens_per_expert(mask, torch.tensor(n, dtype=dtype),
                                                     align_size=align),
                                   tokens_per_expert(mask, n, align_size=align))
    assert torch.equal(tokens_per_expert(mask, torch.tensor(-1)), tokens_per_expert(mask, None))
    assert torch.equal(tokens_per_expert(mask, -1), tokens_per_expert(mask, None))


def test_expert_offsets_dtypes():
    c = torch.tensor([3, 0, 5, 1])
    for dtype in (torch.uint8, torch.int16, torch.int32, torch.int64):
        got = expert_offsets(c.to(dtype))
        assert got.dtype == torch.int32 and got.tolist() == [3, 3, 8, 9]
    big = torch.full((4,), 200, dtype=torch.uint8)  # sums past the counts' own dtype
    assert expert_offsets(big).tolist() == [200, 400, 600, 800]


def _grouped_mm():
    gmm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if gmm is None:
        pytest.skip(f"torch {torch.__version__} has no grouped_mm")
    return gmm


def per_expert_loop(rows, w, offs):
    """``rows [N, H] @ w[e]`` for the rows of each group ``[offs[e-1], offs[e])``; rows past
    ``offs[-1]`` zero."""
    y = rows.new_zeros(rows.shape[0], w.shape[2])
    lo = 0
    for ex, hi in enumerate(offs.tolist()):
        y[lo:hi] = rows[lo:hi] @ w[ex]
        lo = hi
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("rows_kind", ["drops", "spare"])
def test_offsets_drive_grouped_mm(dtype, pad, rows_kind):
    """The expert MLP of a MoE block: permute (with drops), one grouped GEMM over
    ``expert_offsets(tokens_per_expert(...))``, merge; against the per-expert loop and an
    fp64 sum over the kept routes of ``prob * x[t] @ w[e]``. (Torch's CPU grouped_mm takes
    fp32/bf16/fp16 with int32 offs and 16-byte row strides; rows past ``offs[-1]``, the
    spare rows of a buffer bigger than the routes, come back unwritten, and the merge
    never reads them.)"""
    gmm = _grouped_mm()
    t, e, k, h, o, align = 63, 8, 2, 32, 16, 16
    ids, mask = make_routing(t, e, k, "empty_experts" if pad else "random")
    x = torch.randn(t, h).to(dtype)
    probs = torch.rand(t, e).to(dtype)
    w = (torch.randn(e, h, o) / h**0.5).to(dtype)
    routed = int(mask.sum())
    n = routed * 3 // 4 if rows_kind == "drops" else routed + 20
    if pad:
        n = (n + align - 1) // align * align
        rows, pp, rid, _, _ = qmoe.moe_permute_and_pad_with_probs(x, probs, mask, None, align,
                                                                  num_out_tokens=n)
    else:
        rows, pp, rid = qmoe.moe_permute_with_probs(x, probs, mask, n)
    offs = expert_offsets(tokens_per_expert(mask, n, align_size=align if pad else 1))
    y = gmm(rows, w, offs=offs)
    end = int(offs[-1])
    loop = per_expert_loop(rows.float(), w.float(), offs)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
    torch.testing.assert_close(y[:end].float(), loop[:end], **tol)
    merged = qmoe.moe_unpermute(y, rid, probs)
    _, pos, _ = simulate(mask, "mask", e, n, align if pad else 1)
    want = torch.zeros(t, o, dtype=torch.float64)
    for (tok, ex, _), p in zip(R.routes_of(mask, "mask"), pos):
        if p >= 0:
            want[tok] += float(probs[tok, ex]) * (x[tok].double() @ w[ex].double())
    torch.testing.assert_close(merged.double(), want, **tol)
    if rows_kind == "spare":
        assert end < rows.shape[0]  # a tail the GEMM leaves unwritten
    else:
        assert end == rows.shape[0] and want.abs().sum() > 0


def test_compile_fullgraph_dynamic_tokens_once():
    """One graph, ``fullgraph=True``, T marked dynamic: T = 64, 96, 128 compile once and
    equal eager. The graph holds every form: a bool mask with padding and drops, an int8
    mask (its 0/1 check becomes a device assert), an index map (its id-range check too),
    a tensor N, and N as an expression of T."""
    from torch._dynamo.testing import CompileCounterWithBackend

    e, k = 8, 2

    def f(mask, mask_i8, ids, n_tensor):
        t = mask.shape[0]
        a = tokens_per_expert(mask, t, align_size=16)
        b = tokens_per_expert(ids, t * k - 3, map_type="index", num_experts=e)
        c = tokens_per_expert(mask_i8, None)
        d = tokens_per_expert(mask, n_tensor)
        return a, b, c, d, expert_offsets(a), expert_offsets(b)

    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("inductor")
    cf = torch.compile(f, fullgraph=True, backend=cnt)
    for t in (64, 96, 128):
        ids, mask = make_routing(t, e, k, "random")
        args = (mask, mask.to(torch.int8), ids, torch.tensor(t // 3))
        for a in args[:3]:
            torch._dynamo.mark_dynamic(a, 0)
        for got, want in zip(cf(*args), f(*args)):
            assert got.dtype == torch.int32 and torch.equal(got, want)
    assert cnt.frame_count == 1


def _mask():
    return make_routing(8, 4, 2, "random")[1]


def _ids():  # [T, K] = [5, 2] ids of 4 experts: an id 3, a -1, values past 0 and 1
    return torch.tensor([[0, 3], [2, -1], [1, 2], [3, 0], [-1, -1]])


BAD = [
    (lambda: tokens_per_expert([[True]], None), TypeError, "routing_map must be a torch.Tensor"),
    (lambda: tokens_per_expert(_mask()[0], None), ValueError, "routing_map must be 2-d"),
    (lambda: tokens_per_expert(_mask().float(), None), TypeError, "routing_map must have dtype"),
    (lambda: tokens_per_expert(_ids(), None), ValueError, "other than 0 and 1.*map_type='index'"),
    (lambda: tokens_per_expert(_mask(), None, map_type="ids"), ValueError, "map_type"),
    (lambda: tokens_per_expert(_mask(), None, num_experts=5), ValueError, "num_experts=5"),
    (lambda: tokens_per_expert(_ids(), None, map_type="index"), ValueError, "num_experts=E"),
    (lambda: tokens_per_expert(_ids(), None, map_type="index", num_experts=0), ValueError,
     "num_experts must be a positive int"),
    (lambda: tokens_per_expert(_ids(), None, map_type="index", num_experts=-2), ValueError,
     "num_experts must be a positive int"),
    (lambda: tokens_per_expert(_ids(), None, map_type="index", num_experts=4.0), TypeError,
     "num_experts"),
    (lambda: tokens_per_expert(_ids(), None, map_type="index", num_experts=True), TypeError,
     "num_experts"),
    (lambda: tokens_per_expert(_ids(), None, map_type="index", num_experts=3), ValueError,
     "ids must be >= -1 and < num_experts=3"),
    (lambda: tokens_per_expert(_ids() - 2, None, map_type="index", num_experts=4), ValueError,
     "ids must be >= -1"),
    (lambda: tokens_per_expert(_ids().float(), None, map_type="index", num_experts=4),
     TypeError, "routing_map must have dtype"),
    (lambda: tokens_per_expert(_ids().bool(), None, map_type="index", num_experts=4),
     TypeError, "routing_map must have dtype"),
    (lambda: tokens_per_expert(_ids(), None, map_type="index", num_experts=4, align_size=16),
     ValueError, "mask maps only"),
    (lambda: tokens_per_expert(_mask(), None, align_size=0), ValueError, "align_size"),
    (lambda: tokens_per_expert(_mask(), None, align_size=2.0), TypeError, "align_size"),
    (lambda: tokens_per_expert(_mask(), None, align_size=2**30), ValueError, "align_size"),
    (lambda: tokens_per_expert(_mask()), TypeError, "num_out_tokens"),
    (lambda: tokens_per_expert(_mask(), -2), ValueError, "num_out_tokens"),
    (lambda: tokens_per_expert(_mask(), 2.5), TypeError, "num_out_tokens"),
    (lambda: tokens_per_expert(_mask(), True), TypeError, "num_out_tokens"),
    (lambda: tokens_per_expert(_mask(), 2**31), ValueError, "num_out_tokens"),
    (lambda: tokens_per_expert(_mask(), torch.tensor(3.0)), TypeError, "num_out_tokens"),
    (lambda: tokens_per_expert(_mask(), torch.tensor([3])), TypeError, "num_out_tokens"),
    (lambda: tokens_per_expert(_mask(), torch.tensor(-2)), ValueError, "num_out_tokens"),
    (lambda: expert_offsets([1, 2]), TypeError, "counts must be a torch.Tensor"),
    (lambda: expert_offsets(torch.ones(4)), TypeError, "counts must hold integer"),
    (lambda: expert_offsets(torch.ones(4, dtype=torch.bool)), TypeError, "counts must have"),
    (lambda: expert_offsets(torch.ones(2, 4, dtype=torch.int32)), ValueError,
     "counts must be 1-d"),
]


@pytest.mark.parametrize("call,exc,match", BAD)
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


class HostReads(TorchDispatchMode):
    """Refuses the aten ops that read tensor data on the host (``.item()``, ``bool()``,
    ``int()``, ``.tolist()`` all go through ``_local_scalar_dense``) or size a result by
    it: each is a host sync on CUDA."""

    SYNCS = {"_local_scalar_dense", "nonzero", "masked_select", "unique_dim", "_unique2",
             "bincount", "repeat_interleave", "equal", "is_nonzero"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.SYNCS:
            raise AssertionError(f"host read of tensor data: {func}")
        return func(*args, **(kwargs or {}))


def test_no_host_reads(monkeypatch):
    """No call reads tensor data on the host, for every form (on CPU too: torch 2.13's
    ``fullgraph=True`` traces ``.item()`` into the graph instead of refusing it, so the
    compile test would not notice one). The value checks take their CUDA form here
    (``torch._assert_async``; on CPU they read their verdict at once, by design)."""
    from qmoe.ops import checks

    def check_values(fn, cond, msg):
        torch._assert_async(cond, f"{fn}: {msg}")

    monkeypatch.setattr(checks, "check_values", check_values)
    ids, mask = make_routing(1025, 64, 8, "random")
    calls = [
        lambda: tokens_per_expert(mask, 3000),
        lambda: tokens_per_expert(mask, None, align_size=16),
        lambda: tokens_per_expert(mask.to(torch.int8), 3000, align_size=16),
        lambda: tokens_per_expert(ids, 3000, map_type="index", num_experts=64),
        lambda: tokens_per_expert(ids.to(torch.int16), -1, map_type="index", num_experts=64),
        lambda: tokens_per_expert(mask, torch.tensor(3000), align_size=16),
        lambda: expert_offsets(tokens_per_expert(mask, 5000, align_size=16)),
    ]
    with HostReads():
        outs = [fn() for fn in calls]
        with pytest.raises(AssertionError, match="host read"):  # the mode does see one
            bool(outs[0].sum())
    with pytest.raises(RuntimeError, match="num_experts=64"):  # the async check still fires
        tokens_per_expert(ids + 64, 3000, map_type="index", num_experts=64)
    monkeypatch.undo()
    for fn, got in zip(calls, outs):
        assert torch.equal(got, fn())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs only exist with CUDA")
def test_no_host_sync_on_cuda():
    """No call synchronizes with the GPU (``set_sync_debug_mode('error')`` raises on one),
    for every form, and the counts equal the CPU ones."""
    ids, mask = make_routing(1025, 64, 8, "random")
    n_dev = torch.tensor(3000, device="cuda")  # (made before: a copy from the host syncs)
    calls = [
        lambda m, i, n: tokens_per_expert(m, 3000),
        lambda m, i, n: tokens_per_expert(m.to(torch.int8), None, align_size=16),
        lambda m, i, n: tokens_per_expert(i, 3000, map_type="index", num_experts=64),
        lambda m, i, n: tokens_per_expert(m, n, align_size=16),
        lambda m, i, n: tokens_per_expert(m, torch.tensor(3000), align_size=16),  # a CPU N
        lambda m, i, n: expert_offsets(tokens_per_expert(m, 5000, align_size=16)),
    ]
    gpu = (mask.cuda(), ids.cuda(), n_dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = [fn(*gpu) for fn in calls]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for fn, got in zip(calls, outs):
        assert torch.equal(got.cpu(), fn(mask, ids, n_dev.cpu()))

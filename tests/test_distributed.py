"""qmoe.distributed over Gloo on this machine (loopback only, bounded timeouts), and over
NCCL with one process per GPU where the machine has two or more.

Each world (2 and 4 processes) runs every case in one spawn: every rank builds all ranks'
inputs from a shared seed (on the CPU), so it can check what it receives bit for bit and
compare its merged output and gradients with the single-process CPU computation of its own
tokens. On GPUs the merges contract multiply-adds to FMAs, hence the fp32-rounding
tolerances below (rtol 1e-6 on outputs and x gradients), the same on either backend.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import qmoe
from qmoe.distributed import TokenDispatcher, combine, dispatch

L = 2  # experts per rank
H = 160  # not a multiple of 128: partial scale blocks
RECIPES = {
    "bf16": None,
    "blockwise": qmoe.Blockwise(),
    "mxfp8": qmoe.MXFP8(),
    "pertensor": qmoe.PerTensor(),  # quantized with one shared scale: bit-exact moves
}
KINDS = ["random", "rank0_sends_nothing", "expert1_empty", "all_to_last_rank"]


def _inputs(seed: int, world: int, kind: str):
    g = torch.Generator().manual_seed(seed)
    e = world * L
    data = []
    for j in range(world):
        t = 5 + 7 * j
        x = torch.randn(t, H, generator=g).to(torch.bfloat16)
        k = min(3, e)
        ids = torch.rand(t, e, generator=g).argsort(1)[:, :k]
        mask = torch.zeros(t, e, dtype=torch.bool).scatter_(1, ids, True)
        if kind == "rank0_sends_nothing" and j == 0:
            mask[:] = False
        if kind == "expert1_empty":
            mask[:, 1] = False
        if kind == "all_to_last_rank":
            mask[:] = False
            mask[:, e - L] = True
        probs = torch.rand(t, e, generator=g) * mask
        data.append((x, mask, probs))
    return data


def _expert(rows: torch.Tensor, e: int) -> torch.Tensor:
    """Expert e: an elementwise map, so a row's result depends on its expert only."""
    return rows.float() * (0.5 + e) + 0.25 * e


def _quantize(x, name, shared_scale):
    recipe = RECIPES[name]
    if recipe is None:
        return x
    if name == "pertensor":
        return qmoe.quantize(x, recipe, scale=shared_scale)
    return qmoe.quantize(x, recipe)


def _kept(mask: torch.Tensor, world: int, cap: int | None) -> torch.Tensor:
    """The routes that survive a per-rank-pair capacity (expert-major, token-minor)."""
    if cap is None:
        return mask
    kept = torch.zeros_like(mask)
    for j in range(world):
        n = 0
        for e in range(j * L, (j + 1) * L):
            for t in mask[:, e].nonzero().flatten().tolist():
                if n < cap:
                    kept[t, e] = True
                n += 1
    return kept


def _single_process(x, mask, probs, name, shared_scale):
    """Reference: the same block with all experts local."""
    inp = _quantize(x, name, shared_scale)
    out, rid = qmoe.moe_permute(inp, mask)
    rows = out if not isinstance(out, qmoe.QuantizedTensor) else out.dequantize()
    counts = mask.sum(0).tolist()
    ys, start = [], 0
    for e, c in enumerate(counts):
        ys.append(_expert(rows[start : start + c], e))
        start += c
    y = torch.cat(ys) if ys else rows.float()
    return qmoe.moe_unpermute(y, rid, probs)


def _expected_rows(data, rank, world, name, shared_scale, cap):
    """What rank `rank` must receive: per local expert, the rows of every source rank."""
    parts = {}
    for j, (x, mask, _) in enumerate(data):
        kept = _kept(mask, world, cap)
        q = _quantize(x, name, shared_scale)
        out, _ = qmoe.moe_permute(q, kept)
        counts = kept.sum(0).tolist()
        start = sum(counts[: rank * L])
        for l_ in range(L):
            c = counts[rank * L + l_]
            parts[(l_, j)] = out[start : start + c]
            start += c
    return [parts[(l_, j)] for l_ in range(L) for j in range(world)]


def _bits(t):
    if isinstance(t, qmoe.QuantizedTensor):
        return t.qdata.view(torch.uint8), t.raw_scale
    return t, None


def _run_case(rank, world, seed, name, kind, cap, dev="cpu"):
    data = _inputs(seed, world, kind)
    x, mask, probs = data[rank]
    shared = torch.tensor(0.01)
    xg = x.to(dev, copy=True).requires_grad_()
    pg = probs.to(dev, copy=True).requires_grad_()
    inp = _quantize(xg, name, shared.to(dev))
    d = TokenDispatcher(L, capacity=cap)
    expert_in, tpe = d.dispatch(inp, pg, mask.to(dev))
    assert type(expert_in) is type(inp)
    expert_in_dev, expert_in = expert_in, expert_in.cpu() if dev != "cpu" else expert_in
    # Data movement: bit-exact against the reference permutation of every sender's rows.
    want = _expected_rows(data, rank, world, name, shared, cap)
    got_n = sum(int(w.shape[0]) for w in want)
    assert tpe.tolist() == [sum(int(w.shape[0]) for w in want[l_ * world:(l_ + 1) * world])
                            for l_ in range(L)]
    gq, gs = _bits(expert_in[:got_n])
    if want:
        wq, ws = zip(*[_bits(w) for w in want])
        assert torch.equal(gq, torch.cat(wq)), f"{name}/{kind}/{cap}: rows differ"
        if gs is not None and gs.dim():
            assert torch.equal(gs, torch.cat(ws)), f"{name}/{kind}/{cap}: scales differ"
    if cap is not None:
        assert expert_in.shape[0] == world * cap
        pad, _ = _bits(expert_in[got_n:])
        assert not pad.any(), "padding rows must be zero"
    # Experts, combine, gradients.
    ei = expert_in_dev
    rows = ei.dequantize() if isinstance(ei, qmoe.QuantizedTensor) else ei
    ys, start = [], 0
    for l_, c in enumerate(tpe.tolist()):
        ys.append(_expert(rows[start : start + c], rank * L + l_))
        start += c
    ys.append(rows[start:].float())  # capacity padding, never read back
    y = d.combine(torch.cat(ys))
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + rank))
    (y * gy.to(dev)).sum().backward()
    y, xgrad, pgrad = y.detach().cpu(), xg.grad.cpu(), pg.grad.cpu()

    xr = x.clone().requires_grad_()
    pr = probs.clone().requires_grad_()
    yr = _single_process(xr, _kept(mask, world, cap), pr, name, shared)
    (yr * gy).sum().backward()
    torch.testing.assert_close(y, yr, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(xgrad, xr.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pgrad, pr.grad, rtol=1e-5, atol=1e-5)


def _worker(rank, world, store, seed, cases, backend="gloo"):
    dev = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        dev = f"cuda:{rank}"
    with process_group(rank, world, store, backend):
        for case in cases:
            _run_case(rank, world, seed, *case, dev=dev)
        # The function API as well as the module, and a different-scales per-tensor case.
        data = _inputs(seed, world, "random")
        x, mask, probs = (t.to(dev) for t in data[rank])
        q = qmoe.quantize(x * (rank + 1), qmoe.PerTensor())  # per-rank scales differ
        expert_in, tpe, h = dispatch(q, probs, mask, L)
        assert type(expert_in) is qmoe.Float8Tensor
        # bit-exact: every sender's rows rescaled to the largest scale, s_j / max(s), once
        qs = [qmoe.quantize(d[0] * (j + 1), qmoe.PerTensor()) for j, d in enumerate(data)]
        s_max = torch.stack([v.raw_scale.reshape(()) for v in qs]).amax()
        want = []
        for l_ in range(L):
            for j, (_, mj, _) in enumerate(data):
                out_j, _ = qmoe.moe_permute(qs[j], mj)
                lo = int(mj[:, : rank * L + l_].sum())
                rows = out_j.qdata[lo : lo + int(mj[:, rank * L + l_].sum())]
                want.append((rows.float() * (qs[j].raw_scale / s_max)).to(rows.dtype))
        assert torch.equal(expert_in.raw_scale.cpu(), s_max)
        assert torch.equal(expert_in.qdata.cpu().view(torch.uint8),
                           torch.cat(want).view(torch.uint8))
        try:  # a wrong number of expert rows is refused by combine itself (local, no comms)
            combine(torch.zeros(expert_in.shape[0] + 1, H, device=dev), h)
            raise AssertionError("combine took expert_output with a row too many")
        except ValueError as err:
            assert "combine: expert_output must be" in str(err), err
        y = combine(expert_in.dequantize(), h)
        yr = qmoe.moe_unpermute(*_plain_roundtrip(q, mask), probs)
        torch.testing.assert_close(y.float(), yr.float(), rtol=0.13, atol=0.05)  # one fp8 step


def _plain_roundtrip(q, mask):
    out, rid = qmoe.moe_permute(q, mask)
    return out.dequantize(), rid


@contextlib.contextmanager
def process_group(rank: int, world: int, store: str, backend: str = "gloo",
                  seconds: int = 120):
    """A worker's process group on this machine, met through the file ``store`` (no TCP
    port to pick: test processes running side by side cannot race for one), with a
    bounded timeout, destroyed on the way out. A worker that finishes waits at a barrier
    first, so that no rank tears down its connections while a peer still uses them; a
    worker that raises leaves at once (its peers' collectives fail by the timeout)."""
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=seconds))
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn_seeded(worker, world: int, *args, label: str = "distributed") -> None:
    """``worker(rank, world, store, seed, *args)`` in ``world`` processes, ``store`` a
    fresh file path for ``process_group``; the seed from ``QMOE_SEED`` or fresh, printed
    so that a failure can be replayed."""
    seed = int(os.environ.get("QMOE_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"[qmoe] {label} seed={seed}")
    with tempfile.TemporaryDirectory(prefix="qmoe_pg_") as d:
        mp.spawn(worker, args=(world, os.path.join(d, "store"), seed, *args), nprocs=world,
                 join=True)


@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_combine_matches_single_process(world):
    if world == 2:
        cases = [(n, k, c) for n in RECIPES for k in KINDS for c in (None, 9)]
    else:
        cases = [(n, k, c) for n in RECIPES for k in ("random", "all_to_last_rank")
                 for c in (None, 4)]
    spawn_seeded(_worker, world, cases)


NCCL_WORLDS = [w for w in (2, 4) if torch.cuda.device_count() >= w]


@pytest.mark.skipif(not NCCL_WORLDS, reason="needs 2 or more GPUs (NCCL)")
@pytest.mark.parametrize("world", NCCL_WORLDS or [2])
def test_dispatch_combine_over_nccl(world):
    # NVLink multicast stays off (device README): the host's GPUs are shared.
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                 ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ[k] = v
    cases = [(n, k, c) for n in RECIPES for k in KINDS for c in (None, 9)]
    spawn_seeded(_worker, world, cases, "nccl", label="nccl")


# ------------------------------------------------------------------ torch.compile
COMPILE_RECIPES = ["blockwise", "mxfp8", "pertensor"]


def _compiled_block(name: str, cap: int, scale_factor: float):
    """quantize -> dispatch (capacity form) -> experts -> combine, as one function: the
    quantized rows are made inside the compiled region. The expert of each row comes from
    ``tokens_per_local_expert`` on the device (no host read)."""

    def block(x, probs, mask):
        q = qmoe.quantize(x * scale_factor, RECIPES[name])
        expert_in, tpe, h = dispatch(q, probs, mask, L, capacity=cap)
        rows = expert_in.dequantize(torch.float32)
        ends = torch.cumsum(tpe, 0)
        eid = torch.bucketize(torch.arange(rows.shape[0], device=ends.device), ends, right=True)
        y = combine(rows * (1 + eid)[:, None], h)  # padding rows (eid = L) are never read
        return expert_in.detach(), tpe, y

    return block


def _run_block(fn, x, probs, mask, gy):
    xg, pg = x.clone().requires_grad_(), probs.clone().requires_grad_()
    with qmoe.strict_dispatch():  # no op may fall back to dequantization, traced or run
        expert_in, tpe, y = fn(xg, pg, mask)
        (y * gy).sum().backward()
    return expert_in, tpe, y, xg.grad, pg.grad


def _compile_worker(rank, world, store, seed, names, cap):
    with process_group(rank, world, store):
        if world == 1:  # the op quantized rows travel through: schema, fake, autograd
            for n in (6, 0):
                rows = torch.randn(n, H, requires_grad=True)
                torch.library.opcheck(torch.ops.qmoe.all_to_all_rows.default,
                                      (rows, [n], [n], dist.group.WORLD.group_name))
        x, mask, probs = _inputs(seed, world, "random")[rank]
        gy = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + rank))
        for name in names:
            block = _compiled_block(name, cap, float(rank + 1))  # per-rank scales differ
            got = _run_block(torch.compile(block, fullgraph=True), x, probs, mask, gy)
            want = _run_block(block, x, probs, mask, gy)
            assert type(got[0]) is type(want[0])
            assert torch.equal(got[0].qdata.view(torch.uint8), want[0].qdata.view(torch.uint8))
            assert torch.equal(got[0].raw_scale, want[0].raw_scale), name
            for i, what in enumerate(("tokens per expert", "y", "x grad", "probs grad"), 1):
                assert torch.equal(got[i], want[i]), f"{name}: {what} differs"


@pytest.mark.compile
def test_fp8_dispatch_combine_compiles_one_rank():
    """Every FP8 recipe through dispatch + combine (capacity form, forward and backward)
    under torch.compile(fullgraph=True) on a one-rank Gloo group: bit-identical to eager."""
    spawn_seeded(_compile_worker, 1, COMPILE_RECIPES, 7, label="distributed compile")


@pytest.mark.compile
def test_fp8_dispatch_combine_compiles_two_ranks():
    """The compiled capacity form over 2 Gloo ranks, per-tensor FP8 with a different scale on
    each rank (the scale all-gather and the senders' rescale run in the graph; rows, scales,
    output and gradients bit-identical to eager)."""
    spawn_seeded(_compile_worker, 2, ["pertensor"], 9, label="distributed compile")


def test_dispatch_refuses_expert_ids_as_a_mask():
    """An integer routing_map must be a 0/1 mask: [T, K] expert ids taken as one would send
    tokens to the wrong ranks (checked before any collective, so no group is needed)."""
    x = torch.randn(6, H)
    ids = torch.randint(0, 2 * L, (6, 2))
    with pytest.raises(ValueError, match=r"dispatch: routing_map .* other than 0 and 1"):
        dispatch(x, None, ids, L)


def _fused_quantize_worker(rank, world, store, seed):
    with process_group(rank, world, store):
        x, mask, probs = _inputs(seed, world, "random")[rank]
        for name in ("blockwise", "mxfp8", "pertensor"):
            recipe = RECIPES[name]
            for cap in (None, 4):
                xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
                fused, tpe_a, ha = dispatch(xa, probs, mask, L, capacity=cap, quantize=recipe)
                two, tpe_b, hb = dispatch(qmoe.quantize(xb, recipe), probs, mask, L,
                                          capacity=cap)
                assert type(fused) is type(two) and torch.equal(tpe_a, tpe_b), (name, cap)
                assert torch.equal(fused.qdata.view(torch.uint8), two.qdata.view(torch.uint8))
                assert torch.equal(fused.raw_scale, two.raw_scale), (name, cap)
                ya, yb = combine(fused.dequantize(), ha), combine(two.dequantize(), hb)
                assert torch.equal(ya, yb)
                ya.float().square().sum().backward()
                yb.float().square().sum().backward()
                assert torch.equal(xa.grad, xb.grad), (name, cap)
        for bad, msg in ((qmoe.quantize(x, qmoe.RowWise()), "x is already quantized"),
                         (x, "quantize must be None or qmoe.PerTensor()")):
            try:
                dispatch(bad, probs, mask, L, quantize=qmoe.RowWise() if bad is not x
                         else "rowwise")
                raise AssertionError(f"dispatch took bad input ({msg})")
            except TypeError as err:
                assert msg in str(err), err


def test_dispatch_fused_quantize_matches_quantize_then_dispatch():
    """``dispatch(x, ..., quantize=recipe)`` (the quantize in the permute's pass, both the
    exact-split and the capacity form) sends bit for bit what ``dispatch(quantize(x))``
    sends; the merged output and x's gradient are the same."""
    spawn_seeded(_fused_quantize_worker, 2)


def _index_map_worker(rank, world, store, seed):
    with process_group(rank, world, store):
        e = world * L
        g = torch.Generator().manual_seed(seed + rank)
        t, k = 9, 2
        x = torch.randn(t, H, generator=g).to(torch.bfloat16)
        ids = torch.rand(t, e, generator=g).argsort(1)[:, :k]
        ids[0, 1] = -1  # a token with one route
        ids[1] = -1  # a token with none
        w = torch.rand(t, k, generator=g)
        mask = torch.zeros(t, e + 1, dtype=torch.bool).scatter_(
            1, torch.where(ids >= 0, ids, e), True)[:, :e]
        dense = torch.zeros(t, e + 1).scatter(1, torch.where(ids >= 0, ids, e), w)[:, :e]
        for cap in (None, 5):
            wa, wb = w.clone().requires_grad_(), dense.clone().requires_grad_()
            a, tpe_a, ha = dispatch(x, wa, ids, L, capacity=cap, map_type="index")
            b, tpe_b, hb = dispatch(x, wb, mask, L, capacity=cap)
            assert torch.equal(a, b) and torch.equal(tpe_a, tpe_b), cap
            ya, yb = combine(a.float() * 2, ha), combine(b.float() * 2, hb)
            assert torch.equal(ya, yb), cap
            ya.square().sum().backward()
            yb.square().sum().backward()
            assert torch.equal(wa.grad, wb.grad.gather(1, ids.clamp(min=0)) * (ids >= 0)), cap
        for bad, exc, msg in ((torch.full((t, k), e), ValueError, "ids must be >= -1 and < E"),
                              (torch.zeros(t, k, dtype=torch.long), ValueError, "twice"),
                              (mask, TypeError, "integer expert ids")):
            try:
                dispatch(x, None, bad, L, map_type="index")
                raise AssertionError(f"dispatch took a bad index map ({msg})")
            except exc as err:
                assert msg in str(err), err


def test_dispatch_index_map_matches_mask():
    """``dispatch(..., map_type="index")`` with ``[T, K]`` ids (``-1`` for no route) and
    ``[T, K]`` probs moves and merges exactly what the equivalent mask does; the probs'
    gradient comes back per id; bad ids raise."""
    spawn_seeded(_index_map_worker, 2)

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qmoe
from qmoe.ops import reference as R
from tests.tensors.helpers import assert_same_bits

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _random_chunks(rows: int, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(split_sizes, sorted_index)`` on CPU: the first ``rows`` rows cut at c - 1 random
    points (zero-size chunks possible), and a random order of the c chunks."""
    cuts = torch.sort(torch.randint(0, rows + 1, (c - 1,))).values
    sizes = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([rows])]))
    return sizes, torch.randperm(c)


@pytest.mark.parametrize("t,h,c", [(1, 1, 1), (63, 17, 5), (1025, 64, 16), (100, 7168, 3)])
@pytest.mark.parametrize("tail", [0, 9])
def test_sort_chunks_matches_reference(t, h, c, tail):
    x = torch.randn(t + tail, h, dtype=torch.bfloat16, device=DEV)
    sizes, order = _random_chunks(t, c)
    probs = torch.rand(t + tail, device=DEV)
    out, pp = qmoe.moe_sort_chunks_by_index_with_probs(x, probs, sizes.to(DEV), order.to(DEV))
    ref, rpp = R.sort_chunks(x.cpu(), sizes.tolist(), order.tolist(), probs.cpu())
    assert_same_bits(out.cpu(), ref)
    assert_same_bits(pp.cpu(), rpp)
    out2 = qmoe.moe_sort_chunks_by_index(x, sizes.to(DEV), order.to(DEV))
    assert_same_bits(out2, out)


@pytest.mark.parametrize("t,c,dt", [(200, 2, torch.int8), (300, 128, torch.int8),
                                    (40000, 3, torch.int16)])
def test_small_integer_sizes_and_index(t, c, dt):
    """int8 / int16 ``split_sizes`` and ``sorted_index`` whose T or chunk count their
    dtype cannot hold (T = 200 in int8, C = 128 in int8, T = 40000 in int16): the checks
    compare in int64 (they wrapped and refused valid input); the rows equal int64 sizes'."""
    x = torch.randn(t, 2, device=DEV)
    order = torch.randperm(c)
    sizes = torch.full((c,), t // c)  # even sizes: each must fit the dtype (random ones
    sizes[-1] += t - int(sizes.sum())  # of 40000 rows need not fit int16)
    want = qmoe.moe_sort_chunks_by_index(x, sizes.to(DEV), order.to(DEV))
    got = qmoe.moe_sort_chunks_by_index(x, sizes.to(dt).to(DEV), order.to(dt).to(DEV))
    assert_same_bits(got, want)
    if DEV == "cpu":  # on CUDA a device assert, which ends the CUDA context (one runs in a
        # child process: test_compile_ops.py::test_bad_input_under_compile)
        bad = sizes.clone()
        bad[0] += 1
        with pytest.raises(ValueError, match="sum to at most T"):
            qmoe.moe_sort_chunks_by_index(x, bad.to(dt), order.to(dt))


def test_probs_of_shape_t_by_1():
    """``[T, 1]`` probs (TransformerEngine reads them by row stride) give the ``[T]``
    result, and their gradient keeps the ``[T, 1]`` shape."""
    x = torch.randn(40, 8, device=DEV)
    sizes, order = torch.tensor([10, 25, 5], device=DEV), torch.tensor([2, 0, 1], device=DEV)
    p = torch.rand(40, 1, device=DEV, requires_grad=True)
    out, pp = qmoe.moe_sort_chunks_by_index_with_probs(x, p, sizes, order)
    want, wpp = qmoe.moe_sort_chunks_by_index_with_probs(x, p.detach()[:, 0], sizes, order)
    assert torch.equal(out, want) and torch.equal(pp, wpp) and pp.shape == (40,)
    pp.sum().backward()
    assert p.grad.shape == (40, 1) and torch.equal(p.grad, torch.ones(40, 1, device=DEV))


def test_sort_then_inverse_is_identity():
    t = 96
    x = torch.randn(t, 32, device=DEV)
    sizes = torch.tensor([10, 0, 30, 6, 40, 10], device=DEV)
    order = torch.tensor([2, 5, 0, 1, 4, 3], device=DEV)
    y = qmoe.moe_sort_chunks_by_index(x, sizes, order)
    inv = torch.argsort(order)
    back = qmoe.moe_sort_chunks_by_index(y, sizes[order], inv)
    assert torch.equal(back, x)


def test_empty():
    x = torch.randn(0, 8, device=DEV)
    e = torch.zeros(0, dtype=torch.long, device=DEV)
    assert qmoe.moe_sort_chunks_by_index(x, e, e).shape == (0, 8)
    z = torch.zeros(3, dtype=torch.long, device=DEV)
    assert qmoe.moe_sort_chunks_by_index(x, z, torch.arange(3, device=DEV)).shape == (0, 8)


@pytest.mark.parametrize("t,h,c,tail,steps", [
    (1, 1, 1, 0, 1), (63, 17, 5, 9, 1), (1025, 64, 16, 0, 4), (100, 300, 3, 9, 3),
    (40, 8, 300, 3, 1), (0, 8, 4, 5, 1),
    (1200, 1024, 4, 5, 1),  # 4-row programs: most inside one chunk (one offset a program)
])
def test_kernel_matches_reference(kdevice, t, h, c, tail, steps):
    """The one-launch Triton sort (every program derives its rows' sources from the sizes
    and the order) against the reference, into a poisoned output; zero-size chunks (C
    past T included), rows past the chunks, several row tiles a program, programs inside
    one chunk and programs across several; the inverse
    movement (the backward) puts every row and prob back."""
    from qmoe.ops.kernels.sort_chunks import sort_chunks_triton
    from qmoe.ops.tuning import SortChunksTiling

    x = torch.randn(t + tail, h, device=kdevice)
    sizes, order = _random_chunks(t, c)
    # fp64 probs on some cases (Megatron's fp64 routers): they keep their dtype
    probs = torch.rand(t + tail, device=kdevice, dtype=(torch.float32, torch.float64)[t % 2])
    poison = torch.full_like(x, float("nan"))
    tiling = SortChunksTiling(steps=steps)
    out, pp = sort_chunks_triton(x, sizes.to(kdevice), order.to(kdevice), probs,
                                 tiling=tiling, out=poison)
    ref, rpp = R.sort_chunks(x.cpu(), sizes.tolist(), order.tolist(), probs.cpu())
    assert_same_bits(out.cpu(), ref)
    assert_same_bits(pp.cpu(), rpp)
    back, bp = sort_chunks_triton(out, sizes.to(kdevice), order.to(kdevice), pp, inverse=True,
                                  check=False, tiling=tiling)
    assert_same_bits(back, x)
    assert_same_bits(bp, probs)


@pytest.mark.parametrize("h,dtype,steps", [(64, torch.uint8, 1), (90, torch.uint8, 3),
                                           (16, torch.float32, 1), (2048, torch.uint8, None)])
def test_kernel_short_rows_many_chunks(kdevice, h, dtype, steps):
    """Rows with many chunks: byte rows whose layout allows move as int32 words (h = 64,
    2048; not h = 90); short rows' tiles are cut to at most MAX_SCAN_ELEMENTS rows x chunks
    (300 chunks: 512 in the scan), one or several tiles a program; 2048-byte rows take the
    default steps (4 tiles a program: a 512-chunk scan against 8-row tiles)."""
    from qmoe.ops.kernels.sort_chunks import sort_chunks_triton
    from qmoe.ops.tuning import MAX_SCAN_ELEMENTS, SortChunksTiling

    assert MAX_SCAN_ELEMENTS < 256 * 512  # the cut applies here
    t, c = 800, 300
    x = (torch.randint(0, 256, (t + 5, h)) if dtype == torch.uint8
         else torch.randn(t + 5, h)).to(dtype).to(kdevice)
    sizes, order = _random_chunks(t, c)
    poison = torch.full_like(x, 0xFF if dtype == torch.uint8 else float("nan"))
    tiling = SortChunksTiling(steps=steps)
    out, _ = sort_chunks_triton(x, sizes.to(kdevice), order.to(kdevice), tiling=tiling,
                                out=poison)
    assert_same_bits(out.cpu(), R.sort_chunks(x.cpu(), sizes.tolist(), order.tolist())[0])
    back, _ = sort_chunks_triton(out, sizes.to(kdevice), order.to(kdevice), inverse=True,
                                 check=False, tiling=tiling)
    assert_same_bits(back, x)


@pytest.mark.parametrize("h,ns,side_dtype", [(300, 3, torch.float32), (64, 2, torch.uint8),
                                             (128, 4, torch.uint8)])
@pytest.mark.parametrize("words,wide,side_words", [
    (False, False, False), (True, False, False), (True, True, False), (True, None, False),
    (True, False, True), (True, True, True)])
def test_kernel_moves_side_rows(kdevice, h, ns, side_dtype, words, wide, side_words):
    """FP8 bits with their block-scale rows (fp32, or e8m0 bytes) as side rows in one
    launch, forward and inverse, into poisoned outputs; the probs ride along. The bits
    move as bytes or int32 words, in several column tiles; the side tiles in their own
    columns or in the rows' (``side_wide``; None: the launcher's rule, wide at 64 columns);
    byte side rows as int32 words (``side_words``: ns = 4 does, ns = 2 stays bytes)."""
    from qmoe.ops.kernels.sort_chunks import sort_chunks_triton
    from qmoe.ops.tuning import SortChunksTiling

    t, c = 150, 7
    bits = torch.randint(0, 256, (t, h), dtype=torch.uint8, device=kdevice)
    side = torch.randint(0, 256, (t, ns), dtype=torch.uint8).to(side_dtype).to(kdevice)
    probs = torch.rand(t, device=kdevice)
    sizes, order = _random_chunks(t - 9, c)
    so = torch.full_like(side, 0xFF if side_dtype == torch.uint8 else float("nan"))
    # block_h 64: several column tiles at h = 300
    kw = dict(tiling=SortChunksTiling(words=words, side_wide=wide, side_words=side_words,
                                      block_h=64))
    out, pp = sort_chunks_triton(bits, sizes.to(kdevice), order.to(kdevice), probs, side,
                                 out=torch.full_like(bits, 0xFF), side_out=so, **kw)
    ref = R.sort_chunks(bits.cpu(), sizes.tolist(), order.tolist(), probs.cpu())
    assert_same_bits(out.cpu(), ref[0])
    assert_same_bits(pp.cpu(), ref[1])
    assert_same_bits(so.cpu(), R.sort_chunks(side.cpu(), sizes.tolist(), order.tolist())[0])
    so_back = torch.empty_like(side)
    back, _ = sort_chunks_triton(out, sizes.to(kdevice), order.to(kdevice), None, so,
                                 inverse=True, check=False, side_out=so_back, **kw)
    assert_same_bits(back, bits)
    assert_same_bits(so_back, side)
    with pytest.raises(ValueError, match="side and side_out together"):
        sort_chunks_triton(bits, sizes.to(kdevice), order.to(kdevice), None, side)
    with pytest.raises(ValueError, match="side_out must be contiguous"):
        sort_chunks_triton(bits, sizes.to(kdevice), order.to(kdevice), None, side,
                           side_out=torch.empty(ns, t, dtype=side.dtype, device=kdevice).t())


_BAD = {  # (sizes, order, NaN prob): T = 12 rows
    "negative size": ([5, -1, 8], [2, 0, 1], False, "split_sizes must be >= 0"),
    "sizes past T": ([5, 3, 8], [2, 0, 1], False, "sum to at most T"),
    # sizes whose int64 sum wraps below T: each is checked first
    "huge sizes": ([2**62, 2**62, 2**62, 2**62], [0, 1, 2, 3], False, "sum to at most T"),
    "index out of range": ([5, 3, 4], [2, 0, 3], False, "permutation of 0..C-1"),
    "repeated index": ([5, 3, 4], [2, 0, 0], False, "permutation of 0..C-1"),
    "NaN prob": ([5, 3, 4], [2, 0, 1], True, "probs holds NaN"),
}


def _bad_sort(dev, case):
    from qmoe.ops.kernels.sort_chunks import sort_chunks_triton

    sizes, order, nan, _ = _BAD[case]
    probs = torch.rand(12, device=dev)
    if nan:
        probs[7] = float("nan")
    return sort_chunks_triton(torch.randn(12, 4, device=dev), torch.tensor(sizes, device=dev),
                              torch.tensor(order, device=dev), probs)


_CHILD = """
import sys, torch
from tests.ops.test_sort_chunks import _bad_sort
_bad_sort("cuda", sys.argv[1])
torch.cuda.synchronize()
print("no error")
"""


def test_kernel_refuses_bad_sizes_order_and_nan(kdevice, interpreter_asserts):
    """The one-launch sort checks its own inputs (device asserts: program 0 for the sizes
    and the order, every program for the probs it moves). Under the interpreter each bad
    case raises; on CUDA (a device assert ends the context) two run in child processes."""
    if kdevice == "cpu":
        from triton.runtime.errors import InterpreterError

        for case, (*_, msg) in _BAD.items():
            with pytest.raises(InterpreterError, match=msg):
                _bad_sort(kdevice, case)
        return
    for case in ("repeated index", "NaN prob"):
        r = subprocess.run([sys.executable, "-c", _CHILD, case], capture_output=True,
                           text=True, timeout=300, cwd=Path(__file__).parents[2])
        assert r.returncode != 0 and "no error" not in r.stdout, (case, r.stderr[-2000:])
        assert _BAD[case][3] in r.stdout + r.stderr, (case, r.stderr[-4000:])

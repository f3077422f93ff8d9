"""``qmoe.grouped_mm`` against an fp32 per-expert loop: forward, input and weight
gradients, SQNR floors per path; quantized rows, empty groups, a tail past the last
offset, bad input, compile; on Hopper the FP8 row-wise path."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qmoe
from tests.tensors.helpers import assert_same_bits, sqnr_db

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HOPPER = DEV == "cuda" and torch.cuda.get_device_capability()[0] == 9

# SQNR floors (dB) against the fp32 loop: bf16 inputs and outputs (the loop sees the same
# bf16 values; only the GEMM's accumulation and the output rounding differ), and the FP8
# row-wise path (e4m3 rows and weights: about 31 dB each, their product lower).
BF16_FLOOR = 40.0
FP8_FLOOR = 24.0


def _offsets(counts, device=DEV):
    return torch.tensor(counts, device=device).cumsum(0).to(torch.int32)


def _loop(rows: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """fp32 per-expert loop; rows past the last offset zero."""
    out = torch.zeros(rows.shape[0], w.shape[2], dtype=torch.float32, device=rows.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = rows[start:end].float() @ w[e].float()
        start = end
    return out


def _loop_grads(rows, w, offs, g):
    r = rows.detach().float().requires_grad_()
    wf = w.detach().float().requires_grad_()
    (_loop(r, wf, offs) * g.float()).sum().backward()
    return r.grad, wf.grad


def _assert_fwd_bwd(out, ref_rows, leaf, w, offs, counts, floor):
    """``out`` (``grouped_mm`` of rows standing for ``ref_rows``) above ``floor`` dB against
    the fp32 loop, zero past the last offset; then, after its backward, the gradients of
    ``leaf`` (what the rows came from) and ``w`` above the floor too."""
    assert sqnr_db(_loop(ref_rows, w, offs), out.float()) > floor
    assert (out[sum(counts):] == 0).all()
    g = torch.randn(out.shape, device=DEV).bfloat16()
    out.backward(g)
    gr, gw = _loop_grads(ref_rows, w, offs, g)
    assert sqnr_db(gr, leaf.grad.float()) > floor
    assert sqnr_db(gw, w.grad.float()) > floor


CASES = [  # (group sizes, spare rows past the last offset, K, M)
    ([5, 0, 17, 9], 0, 32, 48),  # an empty expert
    ([1], 0, 8, 8),  # one row
    ([0, 64, 0], 7, 16, 24),  # one expert takes all, a tail
    ([33, 30, 1, 0, 63], 3, 64, 16),
]


@pytest.mark.parametrize("counts,spare,k,m", CASES)
def test_bf16_forward_and_grads(counts, spare, k, m):
    n = sum(counts) + spare
    rows = torch.randn(n, k, device=DEV).bfloat16().requires_grad_()
    w = (torch.randn(len(counts), k, m, device=DEV) / k**0.5).bfloat16().requires_grad_()
    offs = _offsets(counts)
    out = qmoe.grouped_mm(rows, w, offs)
    assert out.shape == (n, m) and out.dtype == torch.bfloat16
    _assert_fwd_bwd(out, rows, rows, w, offs, counts, BF16_FLOOR)
    assert (rows.grad[sum(counts):] == 0).all()
    for e, c in enumerate(counts):  # an empty group's weight gradient is exactly zero
        if c == 0:
            assert (w.grad[e] == 0).all()


@pytest.mark.parametrize("recipe", [qmoe.PerTensor(), qmoe.Blockwise(block_size=32),
                                    qmoe.MXFP8()])
def test_quantized_rows_off_hopper_are_dequantized(recipe):
    """Off Hopper (and for blockwise / MX rows everywhere) quantized rows are dequantized
    and run the bf16 path: bit for bit what the dequantized rows give; the gradient flows
    to the quantized input through the dequantization."""
    if HOPPER and isinstance(recipe, qmoe.PerTensor):
        pytest.skip("per-tensor rows run the FP8 path on Hopper (test_fp8_rowwise_path)")
    counts, k, m = [7, 0, 20], 64, 32
    x = torch.randn(sum(counts), k, device=DEV, requires_grad=True)
    q = qmoe.quantize(x.bfloat16(), recipe)
    w = (torch.randn(3, k, m, device=DEV) / 8).bfloat16()
    offs = _offsets(counts)
    got = qmoe.grouped_mm(q, w, offs)
    assert_same_bits(got, qmoe.grouped_mm(q.dequantize(torch.bfloat16), w, offs))
    got.float().sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


@pytest.mark.skipif(not HOPPER, reason="the FP8 grouped GEMM runs on compute capability 9.x")
@pytest.mark.parametrize("recipe", [qmoe.PerTensor(), qmoe.RowWise(),
                                    qmoe.Blockwise(block_size=128)])
@pytest.mark.parametrize("counts", [[100, 0, 37, 256], [64, 64]])
def test_fp8_rowwise_path(recipe, counts):
    """Row-wise FP8 rows (per-tensor, RowWise, or one 128-column block per row at K = 128) through
    torch._scaled_grouped_mm: forward, input and weight gradients above the FP8 floor
    against the fp32 loop of the unquantized values."""
    k, m = 128, 256
    n = sum(counts) + 5
    x = torch.randn(n, k, device=DEV)
    w = (torch.randn(len(counts), k, m, device=DEV) / k**0.5).bfloat16().requires_grad_()
    offs = _offsets(counts)
    xq = x.bfloat16().requires_grad_()
    q = qmoe.quantize(xq, recipe)
    out = qmoe.grouped_mm(q, w, offs)
    assert out.dtype == torch.bfloat16
    _assert_fwd_bwd(out, x, xq, w, offs, counts, FP8_FLOOR)


@pytest.mark.parametrize("recipe", [qmoe.RowWise(), qmoe.PerTensor()])
def test_end_to_end_pad_variant_with_fused_quantize(recipe):
    """``moe_permute_and_pad_with_probs(..., quantize=recipe)`` (groups padded to 16,
    sync-free N), its counts and offsets, the grouped GEMM, the merge: against the fp64 sum
    over kept routes of ``prob * x[t] @ w[e]`` (the FP8 floor: the rows are e4m3)."""
    t, e, k, h, m, align = 96, 8, 2, 64, 32, 16
    ids = torch.rand(t, e, device=DEV).argsort(1)[:, :k]
    mask = torch.zeros(t, e, dtype=torch.bool, device=DEV).scatter_(1, ids, True)
    probs = torch.rand(t, e, device=DEV) * mask
    x = torch.randn(t, h, device=DEV).bfloat16()
    w = (torch.randn(e, h, m, device=DEV) / h**0.5).bfloat16()
    n = t * k + e * (align - 1)
    n = (n + align - 1) // align * align
    rows, _, rid, _, _ = qmoe.moe_permute_and_pad_with_probs(
        x, probs, mask, None, align, num_out_tokens=n, quantize=recipe)
    offs = qmoe.expert_offsets(qmoe.tokens_per_expert(mask, n, align_size=align))
    assert (offs.diff(prepend=offs.new_zeros(1)) % align == 0).all()
    y = qmoe.grouped_mm(rows, w, offs)
    merged = qmoe.moe_unpermute(y, rid, probs)
    want = torch.einsum("te,th,ehm->tm", probs.double(), x.double(), w.double())
    assert sqnr_db(want, merged.double()) > FP8_FLOOR


def test_compile_fullgraph_matches_eager():
    counts, k, m = [9, 0, 23], 16, 24
    rows0 = torch.randn(sum(counts) + 2, k, device=DEV).bfloat16()
    w0 = torch.randn(3, k, m, device=DEV).bfloat16()
    offs = _offsets(counts)

    def run(fn):
        rows, w = rows0.clone().requires_grad_(), w0.clone().requires_grad_()
        out = fn(rows, w, offs)
        out.float().square().sum().backward()
        return out, rows.grad, w.grad

    torch._dynamo.reset()
    got = run(torch.compile(qmoe.grouped_mm, fullgraph=True))
    want = run(qmoe.grouped_mm)
    for a, b in zip(got, want):
        assert_same_bits(a, b)


def _bad_calls():
    r = torch.randn(10, 16, device=DEV).bfloat16()
    w = torch.randn(2, 16, 8, device=DEV).bfloat16()
    o = _offsets([4, 6])
    return [
        ((r[0], w, o), ValueError, "rows must be a 2-D"),
        ((r, w[0], o), ValueError, "weight must be a 3-D"),
        ((r, w.half(), o), TypeError, "weight must be bf16"),
        ((r[:, :8], w, o), ValueError, "the rows' width must be the weights' K"),
        ((r, w, o.long()), TypeError, "offsets must be int32"),
        ((r, w, _offsets([4])), TypeError, r"offsets must be int32 \[E\] = \[2\]"),
        ((r[:, :12], torch.randn(2, 12, 8, device=DEV).bfloat16(), o), ValueError,
         "multiples of 8"),
    ]


@pytest.mark.parametrize("i", range(7))
def test_bad_input(i):
    args, exc, match = _bad_calls()[i]
    with pytest.raises(exc, match=match):
        qmoe.grouped_mm(*args)


@pytest.mark.skipif(DEV != "cpu", reason="on CUDA the offsets check is an async assert")
def test_offsets_past_the_rows_raise():
    """The offsets a framework team once passed (ending at 200 for 163 rows) raise instead
    of reading past the rows; so do falling offsets."""
    r = torch.randn(163, 16).bfloat16()
    w = torch.randn(2, 16, 8).bfloat16()
    for offs in ([100, 200], [100, 50], [-1, 100]):
        with pytest.raises(ValueError, match="offsets must rise from >= 0 to at most N=163"):
            qmoe.grouped_mm(r, w, torch.tensor(offs, dtype=torch.int32))


def test_weight_and_gradient_quantizing_is_rowwise():
    """The FP8 path's quantizing of weights and gradients (``_quantize_last``): per vector
    along the last dim, transposed views included, bit for bit ``qmoe.RowWise``'s."""
    from qmoe.ops.grouped_mm import _quantize_last

    w = torch.randn(3, 40, 24, device=DEV).bfloat16()
    for x in (w, w.transpose(-2, -1), torch.randn(17, 24, device=DEV).bfloat16()):
        q, s = _quantize_last(x)
        want = qmoe.quantize(x.contiguous(), qmoe.RowWise())
        assert q.is_contiguous() and s.shape == x.shape[:-1]
        assert_same_bits(q, want.qdata)
        assert_same_bits(s, want.raw_scale.squeeze(-1))


def test_quantize_expert_weights_layouts():
    """``quantize_expert_weights``: the forward's layout (``[E, M, K]``, per output column)
    and the input gradient's (``[E, K, M]``, per input column), each bit for bit
    ``qmoe.RowWise`` of that orientation; ``backward=False`` leaves the second out."""
    w = torch.randn(3, 40, 24, device=DEV).bfloat16()
    wq = qmoe.quantize_expert_weights(w)
    fwd = qmoe.quantize(w.transpose(-2, -1).contiguous(), qmoe.RowWise())
    bwd = qmoe.quantize(w, qmoe.RowWise())
    assert_same_bits(wq.fwd_bits, fwd.qdata)
    assert_same_bits(wq.fwd_scale, fwd.raw_scale.squeeze(-1))
    assert_same_bits(wq.bwd_bits, bwd.qdata)
    assert_same_bits(wq.bwd_scale, bwd.raw_scale.squeeze(-1))
    fwd_only = qmoe.quantize_expert_weights(w, backward=False)
    assert fwd_only.bwd_bits is None and fwd_only.bwd_scale is None
    assert_same_bits(fwd_only.fwd_bits, wq.fwd_bits)


@pytest.mark.parametrize("recipe", [None, qmoe.RowWise()])
def test_prequantized_weights_match_quantizing_in_the_call(recipe):
    """``weight_fp8=quantize_expert_weights(w)`` gives bit for bit what quantizing in the
    call gives: forward, input and weight gradients (on Hopper the FP8 path reads the
    given bits; elsewhere the argument is not read); the weight gradient reaches ``w``."""
    counts, k, m = [30, 0, 50, 16], 64, 128
    x0 = torch.randn(sum(counts) + 4, k, device=DEV).bfloat16()
    w0 = (torch.randn(4, k, m, device=DEV) / 8).bfloat16()
    offs = _offsets(counts)
    g = torch.randn(x0.shape[0], m, device=DEV).bfloat16()

    def run(pre: bool):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        rows = x if recipe is None else qmoe.quantize(x, recipe)
        wq = qmoe.quantize_expert_weights(w) if pre else None
        out = qmoe.grouped_mm(rows, w, offs, weight_fp8=wq)
        out.backward(g)
        return out, x.grad, w.grad

    for a, b in zip(run(True), run(False)):
        assert_same_bits(a, b)


def test_weight_fp8_bad_input():
    r = torch.randn(10, 16, device=DEV).bfloat16()
    w = torch.randn(2, 16, 8, device=DEV).bfloat16()
    o = _offsets([4, 6])
    other = qmoe.quantize_expert_weights(torch.randn(2, 8, 16, device=DEV).bfloat16())
    with pytest.raises(ValueError, match=r"weight_fp8.fwd_bits must be .*\[2, 8, 16\]"):
        qmoe.grouped_mm(r, w, o, weight_fp8=other)
    with pytest.raises(TypeError, match="weight_fp8 must be qmoe.quantize_expert_weights"):
        qmoe.grouped_mm(r, w, o, weight_fp8=(w, w))
    with pytest.raises(TypeError, match="weight must be a plain"):
        qmoe.quantize_expert_weights(w[0])


@pytest.mark.skipif(not HOPPER, reason="the FP8 grouped GEMM runs on compute capability 9.x")
def test_rowwise_grouped_mm_op():
    """``qmoe::rowwise_grouped_mm`` (the FP8 forward, quantized rows through its passthrough
    rule): opcheck on plain rows; quantized rows give what the plain op gives for rows
    quantized the same way. opcheck's schema test compares inputs before and after with
    ``torch.allclose``, which has no CUDA kernel for the FP8 weight bits: the same check,
    no input written, is made here bit for bit instead."""
    counts, k, m = [20, 0, 45], 64, 32
    rows = torch.randn(70, k, device=DEV).bfloat16()
    wq = qmoe.quantize_expert_weights((torch.randn(3, k, m, device=DEV) / 8).bfloat16())
    args = (rows, wq.fwd_bits, wq.fwd_scale, _offsets(counts))
    before = [a.clone() for a in args]
    # opcheck compares whole outputs: offsets ending at N (the op leaves rows past
    # offsets[-1] unwritten; grouped_mm zeroes them after it)
    full = (rows, wq.fwd_bits, wq.fwd_scale, _offsets([20, 0, 50]))
    torch.library.opcheck(torch.ops.qmoe.rowwise_grouped_mm.default, full,
                          test_utils=("test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))
    plain = torch.ops.qmoe.rowwise_grouped_mm(*args)
    for a, b in zip(args, before):
        assert_same_bits(a, b)
    got = torch.ops.qmoe.rowwise_grouped_mm(qmoe.quantize(rows, qmoe.RowWise()), *args[1:])
    assert_same_bits(got[:65], plain[:65])


@pytest.mark.skipif(not HOPPER, reason="the FP8 grouped GEMM runs on compute capability 9.x")
def test_fp8_path_needs_16_byte_rows():
    """K or M not a multiple of 16: the rows are dequantized (the high-precision path), bit
    for bit what dequantized rows give."""
    counts, k, m = [7, 9], 136, 24
    q = qmoe.quantize(torch.randn(16, k, device=DEV).bfloat16(), qmoe.RowWise())
    w = (torch.randn(2, k, m, device=DEV) / 8).bfloat16()
    offs = _offsets(counts)
    assert_same_bits(qmoe.grouped_mm(q, w, offs),
                     qmoe.grouped_mm(q.dequantize(torch.bfloat16), w, offs))


def test_wide_experts_stay_off_the_fp8_path():
    """K or M over 16384 (one quantize block spans a vector): no FP8 GEMM is chosen and
    ``quantize_expert_weights`` says why."""
    from qmoe.ops.grouped_mm import fp8_gemm_runs

    assert not fp8_gemm_runs(qmoe.RowWise(), DEV, 4096, 28672)
    assert not fp8_gemm_runs(qmoe.RowWise(), DEV, 136, 64)
    assert not fp8_gemm_runs(qmoe.Blockwise(), DEV, 256, 64)  # two blocks a row
    assert fp8_gemm_runs(qmoe.RowWise(), DEV, 4096, 4096) == HOPPER
    assert fp8_gemm_runs(qmoe.Blockwise(), DEV, 128, 64) == HOPPER  # one block a row
    with pytest.raises(ValueError, match="vectors of up to 16384"):
        qmoe.quantize_expert_weights(torch.zeros(1, 16, 16400, device=DEV).bfloat16())


def _nasty_weights(e, k, m, dtype, device):
    """Columns spanning 40 orders of magnitude, a zero column, NaN and inf."""
    w = torch.randn(e, k, m) * torch.logspace(-20, 20, m)[None, None, :]
    if m > 1:
        w[:, :, 1] = 0.0
    if m > 3 and k > 2:
        w[0, 2, 2] = float("nan")
        w[-1, 1, 3] = float("inf")
    return w.to(dtype).to(device)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("e,k,m", [(1, 1, 1), (3, 17, 40), (2, 300, 70), (1, 129, 65)])
def test_quantize_cols_kernel_matches_rows(kdevice, fp8, dtype, e, k, m):
    """``quantize_cols_kernel`` (the weights per output column, written transposed): bit
    for bit the row quantize of the transposed weights, into poisoned outputs (0xFF bytes,
    NaN scales), K past one tile, columns past one tile."""
    from qmoe._intmath import next_pow2
    from qmoe.ops.kernels.grouped_mm import quantize_cols_triton
    from qmoe.tensors.quantize import _reference_blocks

    w = _nasty_weights(e, k, m, dtype, kdevice) if dtype != torch.float16 else (
        torch.randn(e, k, m, device=kdevice) * 100).to(dtype)
    q = torch.full((e, m, k), 0xFF, dtype=torch.uint8, device=kdevice).view(fp8)
    s = torch.full((e, m), float("nan"), device=kdevice)
    quantize_cols_triton(w, fp8, out=(q, s))
    want_q, want_s = _reference_blocks(w.cpu().transpose(-2, -1).contiguous(),
                                       next_pow2(k), fp8, "amax")
    assert_same_bits(q, want_q)
    assert_same_bits(s, want_s.squeeze(-1))


def test_quantize_cols_op():
    """``qmoe::quantize_cols`` passes opcheck; on this device it gives the bits of the row
    quantize of the transposed weights (``_quantize_last``), K = 0 included."""
    from qmoe.ops.grouped_mm import _quantize_last

    for shape in ((3, 40, 24), (2, 1, 16), (1, 0, 8)):
        w = torch.randn(shape, device=DEV).bfloat16()
        torch.library.opcheck(torch.ops.qmoe.quantize_cols.default, (w,))
        q, s = torch.ops.qmoe.quantize_cols(w)
        assert q.shape == (shape[0], shape[2], shape[1]) and s.shape == (shape[0], shape[2])
        if shape[1]:
            want_q, want_s = _quantize_last(w.transpose(-2, -1).contiguous())
            assert_same_bits(q, want_q)
            assert_same_bits(s, want_s)
        else:
            assert (s == 1e-12 / 448).all()
    with pytest.raises(TypeError, match="w must be"):
        torch.ops.qmoe.quantize_cols(torch.zeros(4, 4, dtype=torch.int32, device=DEV))


@pytest.mark.parametrize("n,w,counts", [(1, 1, [0]), (63, 17, [20, 0, 30]), (70, 1030, [70]),
                                        (40, 48, [0, 0]), (1025, 24, [500, 3])])
def test_zero_tail_kernel(kdevice, n, w, counts):
    """``zero_tail_kernel``: rows at or past the last offset zeroed in place, the rows
    before it untouched (NaN-poisoned rows stay NaN), a strided ``out`` included."""
    from qmoe.ops.kernels.grouped_mm import zero_tail_triton

    base = torch.randn(n, w + 5, device=kdevice).bfloat16()
    base[: n // 2] = float("nan")
    out = base[:, 2:w + 2]  # a row stride past the width
    want = out.clone()
    end = sum(counts)
    want[end:] = 0
    zero_tail_triton(out, _offsets(counts, kdevice))
    assert_same_bits(out, want)
    assert torch.equal(base[:, :2].isnan(), (torch.arange(n, device=kdevice) < n // 2)[:, None]
                       .expand(n, 2))


_CHECK_OFFSETS_CHILD = """
import torch
from qmoe.ops.kernels.grouped_mm import check_offsets_triton
check_offsets_triton(torch.tensor([100, 200], dtype=torch.int32, device="cuda"), 163)
torch.cuda.synchronize()
print("no error")
"""


def test_check_offsets_kernel(kdevice, interpreter_asserts):
    """``check_offsets_kernel`` (eager CUDA's offsets check, one launch): rising offsets
    from 0 up to N pass, at 1 to 3000 experts; falling ones, a negative first or a last
    past N fail its device assert (under the interpreter each raises; on CUDA, where an
    assert ends the context, the framework team's [100, 200] for 163 rows runs in a child
    process)."""
    from qmoe.ops.kernels.grouped_mm import check_offsets_triton

    for counts, n in (([0], 0), ([5], 5), ([20, 0, 30], 63), ([1] * 3000, 3000)):
        check_offsets_triton(_offsets(counts, kdevice), n)
    if kdevice == "cpu":
        from triton.runtime.errors import InterpreterError

        for offs, n in (([100, 200], 163), ([100, 50], 163), ([-1, 100], 163), ([4], 3),
                        (list(range(1, 2001)) + [1999], 3000)):
            with pytest.raises(InterpreterError, match="offsets must rise"):
                check_offsets_triton(torch.tensor(offs, dtype=torch.int32), n)
        return
    r = subprocess.run([sys.executable, "-c", _CHECK_OFFSETS_CHILD], capture_output=True,
                       text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert r.returncode != 0 and "no error" not in r.stdout, r.stderr[-2000:]
    assert "offsets must rise" in r.stdout + r.stderr, r.stderr[-4000:]


def test_zero_tail_op():
    """``qmoe::zero_tail_``: opcheck; in place on a contiguous, a column-strided and a
    row-strided ``out``."""
    out = torch.randn(30, 16, device=DEV).bfloat16()
    torch.library.opcheck(torch.ops.qmoe.zero_tail_.default, (out, _offsets([10, 5])))
    base = torch.randn(16, 30, device=DEV).bfloat16()
    for out in (torch.randn(30, 16, device=DEV).bfloat16(), base.t(), base.t()[:, 3:9]):
        want = torch.where(torch.arange(30, device=DEV)[:, None] < 15, out, 0)
        torch.ops.qmoe.zero_tail_(out, _offsets([10, 5]))
        assert_same_bits(out, want)

"""Row offsets past 2**31 elements (int64 offsets): expert 1's group of a pad-variant
permute starts at row 2**20 of 2048-column rows, element 2**31, with only a few tokens
(a huge ``align_size`` pushes it there), so every op that moves or reads those rows
touches offsets an int32 would wrap. CPU (the C++ or torch path) and CUDA (Triton)."""

import pytest
import torch

import qmoe

DEV = "cuda" if torch.cuda.is_available() else "cpu"
H = 2048
ALIGN = 2**20  # expert 0's group padded to 2**20 rows: expert 1 starts at element 2**31
N = ALIGN + 8  # the sync-free bound: expert 1's first 8 rows kept, the rest dropped


def _routing():
    t = 6
    mask = torch.zeros(t, 2, dtype=torch.bool, device=DEV)
    mask[[0, 2, 3], 0] = True
    mask[[1, 2, 4, 5], 1] = True  # token 2 goes to both experts
    return t, mask


def _high_rows(x_rows, out_rows):
    """Expert 1's tokens (1, 2, 4, 5) sit at rows 2**20 .. 2**20 + 3, in token order."""
    assert torch.equal(out_rows[ALIGN:ALIGN + 4].cpu(), x_rows[[1, 2, 4, 5]].cpu())
    assert not out_rows[ALIGN + 4:].cpu().view(torch.uint8).any()  # spare rows zero


@pytest.mark.parametrize("recipe", [None, "pertensor", "blockwise"])
def test_permute_merge_and_sort_past_2_31_elements(recipe):
    t, mask = _routing()
    probs = torch.rand(t, 2, device=DEV)
    x = torch.randn(t, H, device=DEV, dtype=torch.bfloat16)
    r = {None: None, "pertensor": qmoe.PerTensor(), "blockwise": qmoe.Blockwise()}[recipe]
    inp = x if r is None else qmoe.quantize(x, r)
    out, pp, rid, _, _ = qmoe.moe_permute_and_pad_with_probs(inp, probs, mask, None, ALIGN,
                                                             num_out_tokens=N)
    assert out.shape == (N, H) and N * H > 2**31
    rows = (lambda q: q) if r is None else (lambda q: q.qdata.view(torch.uint8))
    _high_rows(rows(inp), rows(out))
    assert torch.equal(pp[ALIGN:ALIGN + 4].cpu(), probs[[1, 2, 4, 5], 1].cpu())
    if r is not None and out.block_size is not None:  # the scale rows moved alike
        _high_rows(inp.scale, out.scale)
    # the merge reads rows past element 2**31 (FP8: dequantized in the merge)
    y = qmoe.moe_unpermute(out, rid, probs)
    deq = x.float() if r is None else inp.dequantize(torch.float32)
    want = torch.zeros(t, H, device=DEV)
    for tok, e in mask.nonzero().tolist():
        want[tok] += deq[tok] * probs[tok, e]
    torch.testing.assert_close(y.float(), want, rtol=2**-7, atol=1e-6)
    if r is None:
        return  # (the chunk sort of 4 GiB of bf16 rows: the FP8 cases move the same rows)
    del y, want
    # the chunk sort moves the high rows to the front (and the front rows past them)
    sizes = torch.tensor([ALIGN, 8], device=DEV)
    moved = qmoe.moe_sort_chunks_by_index(out, sizes, torch.tensor([1, 0], device=DEV))
    assert torch.equal(rows(moved)[:8].cpu(), rows(out)[ALIGN:].cpu())
    assert torch.equal(rows(moved)[8:16].cpu(), rows(out)[:8].cpu())


def test_fused_quantize_permute_past_2_31_elements():
    t, mask = _routing()
    probs = torch.rand(t, 2, device=DEV)
    x = torch.randn(t, H, device=DEV, dtype=torch.bfloat16)
    out = qmoe.moe_permute_and_pad_with_probs(x, probs, mask, None, ALIGN, num_out_tokens=N,
                                              quantize=qmoe.MXFP8())[0]
    q = qmoe.quantize(x, qmoe.MXFP8())
    _high_rows(q.qdata.view(torch.uint8), out.qdata.view(torch.uint8))
    _high_rows(q.raw_scale, out.raw_scale)
